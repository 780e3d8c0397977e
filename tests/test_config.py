from pathlib import Path

import pytest

from nmtflow.config import ConfigError, load_config
from nmtflow.models.transformer import TransformerConfig
from nmtflow.nn.attention import AttentionConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_presets_load_with_their_sizes() -> None:
    for size, (d, ffn, heads) in {"small": (256, 1024, 4), "base": (512, 2048, 8), "big": (1024, 4096, 16)}.items():
        cfg = load_config(CONFIGS / f"transformer-{size}.yaml")
        assert isinstance(cfg.model, TransformerConfig)
        assert (cfg.model.d_model, cfg.model.ffn_dim, cfg.model.heads) == (d, ffn, heads)
        assert (cfg.model.encoder_layers, cfg.model.decoder_layers) == (6, 6)


@pytest.mark.parametrize("text, key", [
    ("model: {name: transformer, d_modle: 3}\n", "d_modle"),
    ("train: {max_update: 3}\n", "max_update"),
    ("trian: {}\n", "trian"),
    ("model: {cross_attention: {type: standard, ngrams: [1]}}\n", "ngrams"),
])
def test_unknown_keys_are_errors_naming_file_and_key(tmp_path: Path, text: str, key: str) -> None:
    path = write(tmp_path, "bad.yaml", text)
    with pytest.raises(ConfigError, match=rf"bad\.yaml.*{key}"):
        load_config(path)


def test_wrong_types_and_unknown_names(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_updates: expected an integer"):
        load_config(write(tmp_path, "a.yaml", "train: {max_updates: many}\n"))
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        load_config(write(tmp_path, "b.yaml", "model: {name: nope}\n"))
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config(write(tmp_path, "c.yaml", "model: {preset: huge}\n"))
    with pytest.raises(ConfigError, match="unknown attention 'nope'"):
        load_config(write(tmp_path, "d.yaml", "model: {encoder_self_attention: {type: nope}}\n"))


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"e\.yaml:2"):
        load_config(write(tmp_path, "e.yaml", "train:\n\tlr: 1\n"))


def test_base_inheritance_and_overrides(tmp_path: Path) -> None:
    write(tmp_path, "parent.yaml", "model: {preset: small, encoder_layers: 3}\ntrain: {lr: 0.001}\n")
    child = write(tmp_path, "child.yaml", "base: parent.yaml\nmodel: {decoder_layers: 2}\n")
    cfg = load_config(child, ["train.max_updates=7", "model.heads=8"])
    assert (cfg.model.d_model, cfg.model.encoder_layers, cfg.model.decoder_layers) == (256, 3, 2)
    assert cfg.model.heads == 8 and cfg.train.max_updates == 7 and cfg.train.lr == 0.001
    assert isinstance(cfg.model.cross_attention, AttentionConfig)


def test_round_trip_through_dict() -> None:
    from nmtflow.config import config_from_dict

    cfg = load_config(CONFIGS / "transformer-small.yaml", ["model.encoder_layers=2"])
    again = config_from_dict(cfg.to_dict())
    assert again == cfg
