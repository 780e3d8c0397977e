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


def test_yaml_1_2_scalars_and_duplicate_keys(tmp_path: Path) -> None:
    # 5e-4 is a number and `no` a string (YAML 1.1 would read a string and False), in files and overrides
    cfg = load_config(write(tmp_path, "a.yaml", "train: {lr: 5e-4}\ndata: {src_lang: no, tgt_lang: on}\n"))
    assert (cfg.train.lr, cfg.data.src_lang, cfg.data.tgt_lang) == (5e-4, "no", "on")
    cfg = load_config(CONFIGS / "transformer-small.yaml",
                      ["train.lr=1E-3", "data.tgt_lang=yes", "train.progress=false"])
    assert (cfg.train.lr, cfg.data.tgt_lang, cfg.train.progress) == (1e-3, "yes", False)
    with pytest.raises(ConfigError, match=r"b\.yaml:3: invalid YAML \(duplicate key 'train'\)"):
        load_config(write(tmp_path, "b.yaml", "train: {lr: 0.001}\ndata: {}\ntrain: {max_updates: 10}\n"))


def test_bad_override_values_are_config_errors() -> None:
    small = CONFIGS / "transformer-small.yaml"
    with pytest.raises(ConfigError, match=r"override 'train.lr=\[1,': invalid YAML value"):
        load_config(small, ["train.lr=[1,"])
    for override, message in (("model.name=[x]", "unknown model"), ("model.preset=[x]", "unknown preset"),
                              ("model.encoder_self_attention.type=[x]", "unknown attention")):
        with pytest.raises(ConfigError, match=message):
            load_config(small, [override])
    for section in ("model", "train"):  # `model=null` rebuilt the default Transformer, `train=null` default training
        with pytest.raises(ConfigError, match=f"override '{section}=null': '{section}' is a section"):
            load_config(small, [f"{section}=null"])
    assert load_config(small, ["data.multilingual=null"]).data.multilingual is None  # a null value stays one


@pytest.mark.parametrize("override, key", [
    ("train.update_freq=0", "update_freq"), ("train.log_every=0", "log_every"),
    ("train.validate_every=-1", "validate_every"),
    ("train.early_stop_metric=blue", "early_stop_metric"), ("train.label_smoothing=1.5", "label_smoothing"),
    ("train.device=gpu", "device"), ("train.valid_bleu_max_sentences=0", "valid_bleu_max_sentences"),
    ("train.max_minutes=0", "max_minutes"), ("train.lr=0", "lr"),
])
def test_training_settings_out_of_range(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"train\.{key}|train: {key}|{key} must"):
        load_config(CONFIGS / "transformer-small.yaml", [override])


def test_an_empty_section_keeps_its_base(tmp_path: Path) -> None:
    write(tmp_path, "parent.yaml", "train: {lr: 0.001, max_updates: 20}\ndata: {src_lang: fr}\n")
    child = write(tmp_path, "child.yaml", "base: parent.yaml\ntrain:\n  # max_updates: 5\ndata:\n")
    cfg = load_config(child, ["data.tgt_lang=cs"])
    assert (cfg.train.lr, cfg.train.max_updates, cfg.data.src_lang, cfg.data.tgt_lang) == (0.001, 20, "fr", "cs")


def test_unknown_keys_name_the_file_or_override_that_set_them(tmp_path: Path) -> None:
    write(tmp_path, "parent.yaml", "train: {lrr: 0.1}\n")
    child = write(tmp_path, "child.yaml", "base: parent.yaml\nmodel: {preset: small}\n")
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'parent.yaml'}: train: unknown key 'lrr'"):
        load_config(child)
    fine = write(tmp_path, "fine.yaml", "base: transformer.yaml\n")
    write(tmp_path, "transformer.yaml", "model: {preset: small}\n")
    with pytest.raises(ConfigError, match=r"^override 'train.foo=1': train: unknown key 'foo'"):
        load_config(fine, ["train.foo=1"])
    with pytest.raises(ConfigError, match=r"^override 'model.d_modle=8': model: unknown key 'd_modle'"):
        load_config(fine, ["model.d_modle=8"])
    with pytest.raises(ConfigError, match=rf"^{fine}: train: unknown key 'bar'"):
        load_config(write(tmp_path, "fine.yaml", "base: transformer.yaml\ntrain: {bar: 1}\n"))


def test_a_preset_name_reads_the_shipped_preset(tmp_path, monkeypatch) -> None:
    """``nmtflow train shortcuts-small`` and ``base: transformer-small`` from any directory, as in experiments."""
    from nmtflow.config import PRESETS_DIR, to_dict

    monkeypatch.chdir(tmp_path)
    assert to_dict(load_config("shortcuts-small")) == to_dict(load_config(PRESETS_DIR / "shortcuts-small.yaml"))
    (tmp_path / "mine.yaml").write_text("base: transformer-small\nmodel: {encoder_layers: 2}\n", encoding="utf-8")
    mine = load_config("mine.yaml")
    assert mine.model.encoder_layers == 2 and mine.model.d_model == load_config("transformer-small").model.d_model
    (tmp_path / "transformer-small.yaml").write_text("model: {name: rnn}\n", encoding="utf-8")
    assert load_config("transformer-small.yaml").model.name == "rnn"  # a file of that name comes first
    with pytest.raises(ConfigError, match=r"^transformer-smal: config file not found \(nor a preset of configs/"):
        load_config("transformer-smal")
    with pytest.raises(ConfigError, match=r"^sub/transformer-small: config file not found"):
        load_config("sub/transformer-small")  # a path is a path


def test_an_empty_config_or_a_missing_base_names_the_file_that_says_so(tmp_path) -> None:
    """An empty file is not nmtflow's defaults (a 44M Transformer) in disguise; a base that is not there is named
    with the config that refers to it and where a relative one was looked for."""
    for text in ("", "# only a comment\n\n"):
        with pytest.raises(ConfigError, match=rf"^{tmp_path / 'empty.yaml'}: an empty file; give at least"):
            load_config(write(tmp_path, "empty.yaml", text))
    assert load_config(write(tmp_path, "defaults.yaml", "{}\n")).model.name == "transformer"  # asked for
    child = write(tmp_path, "child.yaml", "base: nothere.yaml\n")
    with pytest.raises(ConfigError) as missing:
        load_config(write(tmp_path, "grandchild.yaml", "base: child.yaml\n"))
    assert str(missing.value) == (f"{child}: base: nothere.yaml: config file not found (nor a preset of configs/); a "
                                  f"relative base is read from the directory of child.yaml ({tmp_path / 'nothere.yaml'})")
    with pytest.raises(ConfigError, match=rf"^{child}: base: {tmp_path}: a directory, not a config file$"):
        load_config(write(tmp_path, "child.yaml", f"base: {tmp_path}\n"))
    run = tmp_path / "run"  # before: "config file not found" for a directory given as the config itself
    run.mkdir()
    with pytest.raises(ConfigError, match=rf"^{run}: a directory, not a config file$"):
        load_config(run)
    write(run, "config.yaml", "{}\n")
    with pytest.raises(ConfigError, match=rf"^{run}: a directory, not a config file \(its config\.yaml is one\)$"):
        load_config(run)


@pytest.mark.parametrize("override, message", [
    ("decode.beam_size=0", "decode.beam_size: must be >= 1, got 0"),
    ("decode.max_tokens=-1", "decode.max_tokens: must be >= 1, got -1"),
    ("decode.nbest=6", "decode.nbest: 6 is more than beam_size 5"),
    ("decode.len_penalty=.nan", "decode.len_penalty: must be a finite number"),
    ("decode.max_len_a=-1", "decode.max_len_a: must be >= 0"),
    ("decode.max_len_b=-1", "decode.max_len_b: must be >= 0"),
])
def test_decode_settings_that_cannot_work_are_config_errors(override: str, message: str) -> None:
    """Before: accepted at load, failing (or misbehaving) only when decoding started."""
    with pytest.raises(ConfigError, match=f"override '{override}': {message}"):
        load_config("transformer-small", [override])
