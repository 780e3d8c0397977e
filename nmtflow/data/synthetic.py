"""The built-in synthetic multilingual corpus: seeded, multi-way parallel en/de/fr text.

A small grammar samples a language-independent meaning (``Sentence``) once; one realiser per language
renders it.  The grammar is built to need real translation knowledge: a lexicon of a few hundred content
words, non-compositional phrases and idioms ("in front of" = "vor" = "devant", "is hungry" = "hat Hunger"
= "a faim"), reordering (French post-nominal adjectives, German V2 and verb-final subordinate clauses,
separable verbs), and agreement (German case/gender/number declension, French gender/number agreement,
subject-verb agreement).  Pure Python ``random.Random``: the same seed gives the same corpus everywhere.
"""
from __future__ import annotations

import itertools
import json
import logging
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Iterator, Sequence

log = logging.getLogger("nmtflow.corpus")

DEFAULT_LANGS: tuple[str, ...] = ("en", "de", "fr")
SUPPORTED_LANGS: tuple[str, ...] = ("en", "de", "fr")
MIN_WORDS, MAX_WORDS = 4, 30

# ---------------------------------------------------------------------------------------------- lexicon
# Noun entry: "en[/en_pl] g:de/de_pl g:fr[/fr_pl] [flags]"; "_" stands for a space inside a word.
# Flags: C colourable, I/O/U/F usable after in / on / under / in-front-of-behind-next-to-near,
# R readable, X openable, W writable, T throwable; lowercase i/a/z/u: German "go to" preposition (in/an/zu/auf).
_NOUNS = {
    "p": """man/men m:Mann/Männer m:homme; woman/women f:Frau/Frauen f:femme; child/children n:Kind/Kinder m:enfant;
        girl n:Mädchen/Mädchen f:fille; teacher m:Lehrer/Lehrer m:professeur; doctor m:Arzt/Ärzte m:médecin;
        friend m:Freund/Freunde m:ami; cook m:Koch/Köche m:cuisinier; farmer m:Landwirt/Landwirte m:agriculteur;
        king m:König/Könige m:roi; queen f:Königin/Königinnen f:reine; baker m:Bäcker/Bäcker m:boulanger;
        sister f:Schwester/Schwestern f:sœur; brother m:Bruder/Brüder m:frère; mother f:Mutter/Mütter f:mère;
        father m:Vater/Väter m:père; grandmother f:Großmutter/Großmütter f:grand-mère/grands-mères;
        pupil m:Schüler/Schüler m:élève; driver m:Fahrer/Fahrer m:chauffeur; waiter m:Kellner/Kellner m:serveur;
        uncle m:Onkel/Onkel m:oncle; aunt f:Tante/Tanten f:tante; baby n:Baby/Babys m:bébé;
        guest m:Gast/Gäste m:invité; singer m:Sänger/Sänger m:chanteur; painter m:Maler/Maler m:peintre;
        thief/thieves m:Dieb/Diebe m:voleur; fisherman/fishermen m:Fischer/Fischer m:pêcheur;
        nurse f:Krankenschwester/Krankenschwestern f:infirmière""",
    "a": """dog m:Hund/Hunde m:chien; cat f:Katze/Katzen m:chat; horse n:Pferd/Pferde m:cheval/chevaux;
        cow f:Kuh/Kühe f:vache; bird m:Vogel/Vögel m:oiseau; mouse/mice f:Maus/Mäuse f:souris;
        fish/fish m:Fisch/Fische m:poisson; rabbit n:Kaninchen/Kaninchen m:lapin; sheep/sheep n:Schaf/Schafe m:mouton;
        pig n:Schwein/Schweine m:cochon; duck f:Ente/Enten m:canard; wolf/wolves m:Wolf/Wölfe m:loup;
        fox m:Fuchs/Füchse m:renard; goat f:Ziege/Ziegen f:chèvre; chicken n:Huhn/Hühner f:poule;
        frog m:Frosch/Frösche f:grenouille; snake f:Schlange/Schlangen m:serpent; donkey m:Esel/Esel m:âne;
        tiger m:Tiger/Tiger m:tigre; spider f:Spinne/Spinnen f:araignée; bee f:Biene/Bienen f:abeille;
        butterfly m:Schmetterling/Schmetterlinge m:papillon; turtle f:Schildkröte/Schildkröten f:tortue;
        squirrel n:Eichhörnchen/Eichhörnchen m:écureuil""",
    "o": """ball m:Ball/Bälle m:ballon CT; book n:Buch/Bücher m:livre CRXW; letter m:Brief/Briefe f:lettre RXW;
        key m:Schlüssel/Schlüssel f:clé T; box f:Kiste/Kisten f:boîte CIX; cup f:Tasse/Tassen f:tasse C;
        chair m:Stuhl/Stühle f:chaise COU; table m:Tisch/Tische f:table COU; bag f:Tasche/Taschen m:sac CIX;
        hat m:Hut/Hüte m:chapeau CT; shoe m:Schuh/Schuhe f:chaussure CT;
        umbrella m:Regenschirm/Regenschirme m:parapluie CU; car n:Auto/Autos f:voiture CIF;
        bicycle n:Fahrrad/Fahrräder m:vélo C; picture n:Bild/Bilder m:tableau;
        newspaper f:Zeitung/Zeitungen m:journal R; window n:Fenster/Fenster f:fenêtre FX;
        door f:Tür/Türen f:porte CFX; lamp f:Lampe/Lampen f:lampe C; clock f:Uhr/Uhren f:horloge;
        phone n:Telefon/Telefone m:téléphone C; pen m:Stift/Stifte m:stylo CT; knife/knives n:Messer/Messer m:couteau;
        spoon m:Löffel/Löffel f:cuillère; plate m:Teller/Teller f:assiette C;
        bottle f:Flasche/Flaschen f:bouteille CX; basket m:Korb/Körbe m:panier I; ring m:Ring/Ringe f:bague;
        coat m:Mantel/Mäntel m:manteau C; shirt n:Hemd/Hemden f:chemise C; toy n:Spielzeug/Spielzeuge m:jouet CT;
        stone m:Stein/Steine f:pierre T; flower f:Blume/Blumen f:fleur C;
        kite m:Drachen/Drachen m:cerf-volant/cerfs-volants C; candle f:Kerze/Kerzen f:bougie C;
        mirror m:Spiegel/Spiegel m:miroir; map f:Karte/Karten f:carte R; ticket f:Fahrkarte/Fahrkarten m:billet;
        gift n:Geschenk/Geschenke m:cadeau X""",
    "f": """apple m:Apfel/Äpfel f:pomme; bread n:Brot/Brote m:pain; cake m:Kuchen/Kuchen m:gâteau;
        egg n:Ei/Eier m:œuf; banana f:Banane/Bananen f:banane; cheese m:Käse/Käse m:fromage;
        soup f:Suppe/Suppen f:soupe; potato/potatoes f:Kartoffel/Kartoffeln f:pomme_de_terre/pommes_de_terre;
        carrot f:Karotte/Karotten f:carotte; sandwich n:Sandwich/Sandwiches m:sandwich; pear f:Birne/Birnen f:poire;
        strawberry f:Erdbeere/Erdbeeren f:fraise; cherry f:Kirsche/Kirschen f:cerise;
        tomato/tomatoes f:Tomate/Tomaten f:tomate; cookie m:Keks/Kekse m:biscuit; sausage f:Wurst/Würste f:saucisse""",
    "d": """milk f:Milch m:lait; water n:Wasser f:eau; coffee m:Kaffee m:café; tea m:Tee m:thé; juice m:Saft m:jus;
        lemonade f:Limonade f:limonade; wine m:Wein m:vin""",
    "l": """house n:Haus/Häuser f:maison CIF; tree m:Baum/Bäume m:arbre UF; school f:Schule/Schulen f:école IFi;
        park m:Park/Parks m:parc IFi; garden m:Garten/Gärten m:jardin IFi; river m:Fluss/Flüsse f:rivière Fa;
        lake m:See/Seen m:lac Fa; beach m:Strand/Strände f:plage Fa; station m:Bahnhof/Bahnhöfe f:gare IFz;
        church f:Kirche/Kirchen f:église IFi; market m:Markt/Märkte m:marché Fu; bridge f:Brücke/Brücken m:pont UFz;
        cinema n:Kino/Kinos m:cinéma IFi; library f:Bibliothek/Bibliotheken f:bibliothèque IFi;
        hospital n:Krankenhaus/Krankenhäuser m:hôpital IFi; museum n:Museum/Museen m:musée IFi;
        shop m:Laden/Läden m:magasin IFi; bakery f:Bäckerei/Bäckereien f:boulangerie IFz;
        restaurant n:Restaurant/Restaurants m:restaurant IFi; forest m:Wald/Wälder f:forêt IFi;
        mountain m:Berg/Berge f:montagne Fu; castle n:Schloss/Schlösser m:château IFz;
        hotel n:Hotel/Hotels m:hôtel IFi; office n:Büro/Büros m:bureau IFi; kitchen f:Küche/Küchen f:cuisine IFi;
        wall f:Mauer/Mauern m:mur CF; farm m:Bauernhof/Bauernhöfe f:ferme Fu; village n:Dorf/Dörfer m:village IFi;
        city f:Stadt/Städte f:ville IFi; zoo m:Zoo/Zoos m:zoo IFi; bench f:Bank/Bänke m:banc COUF""",
}
# Adjective entry: "en de[=stem] fr_ms[/fs[/mp[/fp]]][|before-vowel] categories [b = before the noun in French]".
_ADJS = """big groß grand paol b; small klein petit paol b; old alt vieux/vieille/vieux/vieilles|vieil paol b;
    new neu nouveau/nouvelle/nouveaux/nouvelles|nouvel ol b; young jung jeune pa b;
    beautiful schön beau/belle/beaux/belles|bel paol b; good gut bon/bonne pafd b;
    bad schlecht mauvais/mauvaise/mauvais fd b; pretty hübsch joli pol b; long lang long/longue o b;
    happy glücklich heureux/heureuse/heureux pa; sad traurig triste pa; tired müde fatigué pa; angry wütend fâché pa;
    friendly freundlich gentil/gentille pa; clever klug intelligent pa; lazy faul paresseux/paresseuse/paresseux pa;
    strong stark fort pad; fast schnell rapide pa; slow langsam lent pa; heavy schwer lourd o;
    light leicht léger/légère o; cheap billig bon_marché/bon_marché/bon_marché/bon_marché of;
    expensive teuer=teur cher/chère ofdl; dirty schmutzig sale paol; clean sauber propre ol; warm warm chaud fd;
    cold kalt froid fdl; quiet ruhig calme pal; loud laut bruyant pal; famous berühmt célèbre pl;
    dangerous gefährlich dangereux/dangereuse/dangereux al; empty leer vide ol; full voll plein o;
    wet nass mouillé pao; dry trocken sec/sèche of; round rund rond o; soft weich doux/douce/doux o;
    funny lustig drôle p; strange seltsam étrange paol; rich reich riche p; poor arm pauvre p;
    brave mutig courageux/courageuse/courageux pa; curious neugierig curieux/curieuse/curieux pa;
    shy schüchtern timide pa; fresh frisch frais/fraîche/frais fd; sweet süß sucré fd;
    delicious lecker délicieux/délicieuse/délicieux fd; sick krank malade pa"""
_COLOURS = """red rot rouge; blue blau bleu; green grün vert; yellow gelb jaune; black schwarz noir;
    white weiß blanc/blanche; brown braun marron/marron/marron/marron; grey grau gris/grise/gris; pink rosa= rose;
    purple lila= violet/violette"""
# Frame: kind | subject categories | object spec | en | de | fr | options (N negatable, F frequency adverb,
# Q question, P prepositional phrase, L "likes to").  de: "^" = position of "nicht", "X+" = separable prefix,
# SICH/SE reflexive, #g:Noun negated with "kein", POSS French possessive, ~adj agrees with the subject.
_FRAMES = """tr|pa|paofl|see {O}|sehen:sieh {O:a} ^|voir {O}|NFQP
tr|pa|f|eat {O}|essen:iss {O:a} ^|manger {O}|NFQP
tr|pa|d|drink {O}|trinken {O:a} ^|boire {O}|NFQP
tr|p|ofd|buy {O}|kaufen {O:a} ^|acheter {O}|NFQP
tr|p|o:R|read {O}|lesen:lies {O:a} ^|lire {O}|NFQP
tr|pa|paofd|like {O}|mögen {O:a} ^|aimer {O}|NFQ
tr|pa|o|find {O}|finden {O:a} ^|trouver {O}|NFQP
tr|p|ao|carry {O}|tragen:träg {O:a} ^|porter {O}|NFQP
tr|p|o:T|throw {O}|werfen:wirf {O:a} ^|lancer {O}|NFQP
tr|pa|ofd|need {O}|brauchen {O:a} ^|avoir besoin de {O}|NFQ
tr|p|pa|help {O}|helfen:hilf {O:d} ^|aider {O}|NFQP
tr|pa|pa|follow {O}|folgen {O:d} ^|suivre {O}|NFQP
tr|p|p|call {O}|rufen {O:a} ^ an+|appeler {O}|NFQP
tr|pa|paol|look at {O}|sehen:sieh {O:a} ^ an+|regarder {O}|NFQP
tr|pa|pa|wait for {O}|warten ^ auf {O:a}|attendre {O}|NFQP
tr|pa|p|listen to {O}|hören {O:d} ^ zu+|écouter {O}|NFQP
tr|p|o|pick up {O}|heben {O:a} ^ auf+|ramasser {O}|NFQP
tr|p|p|talk to {O}|sprechen:sprich ^ mit {O:d}|parler à {O}|NFQP
tr|p|p|visit {O}|besuchen {O:a} ^|rendre visite à {O}|NFQ
tr|p|pao|draw {O}|zeichnen {O:a} ^|dessiner {O}|NFQP
tr|p|ao|wash {O}|waschen:wäsch {O:a} ^|laver {O}|NFQP
tr|p|ao|hold {O}|halten:hält {O:a} ^|tenir {O}|NFQP
tr|p|o:X|open {O}|öffnen {O:a} ^|ouvrir {O}|NFQ
tr|p|o:X|close {O}|schließen {O:a} ^|fermer {O}|NFQ
tr|pa|pa|love {O}|lieben {O:a} ^|adorer {O}|NFQ
tr|pa|pao|look for {O}|suchen {O:a} ^|chercher {O}|NFQP
tr|pa|a|catch {O}|fangen:fäng {O:a} ^|attraper {O}|NFQP
tr|p|f|cook {O}|kochen {O:a} ^|préparer {O}|NFQP
tr|p|o:W|write {O}|schreiben {O:a} ^|écrire {O}|NFQP
tr|p|of|sell {O}|verkaufen {O:a} ^|vendre {O}|NFQP
tr|p|ofd|bring {O}|bringen {O:a} ^|apporter {O}|NFQP
tr|p|of|take {O}|nehmen:nimm {O:a} ^|prendre {O}|NFQP
tr|p|p|make fun of {O}|machen SICH ^ über {O:a} lustig|SE moquer de {O}|NFQ
in|pa||sleep|schlafen:schläf ^|dormir|NFQPL
in|pa||run|laufen:läuf ^|courir|NFQPL
in|p||laugh|lachen ^|rire|NFQPL
in|pa||sing|singen ^|chanter|NFQPL
in|p||work|arbeiten ^|travailler|NFQPL
in|pa||play|spielen ^|jouer|NFQPL
in|pa||swim|schwimmen ^|nager|NFQL
in|p||dance|tanzen ^|danser|NFQPL
in|pa||wait|warten ^|attendre|NFQPL
in|p||cry|weinen ^|pleurer|NFQPL
in|pa||sit|sitzen ^|être ~assis|NFQPL
in|pa||stand|stehen ^|être debout|NFQPL
in|pa||jump|springen ^|sauter|NFQPL
in|p||travel|reisen ^|voyager|NFQL
in|p||smile|lächeln ^|sourire|NFQPL
in|p||shout|schreien ^|crier|NFQPL
cop|paofdl||be ADJ|sein ^ ADJ|être ADJ|NFQ
st|pa||be hungry|haben #m:Hunger|avoir faim|NFQ
st|pa||be thirsty|haben #m:Durst|avoir soif|NFQ
st|pa||be afraid|haben #f:Angst|avoir peur|NFQ
st|p||be right|haben ^ recht|avoir raison|NQ
st|pa||be cold|frieren ^|avoir froid|NFQ
st|pa||be {N} years old|sein ^ {N} Jahre alt|avoir {N} ans|NQ
st|p||be in a hurry|haben es ^ eilig|être ~pressé|NFQ
st|p||be over the moon|sein ^ im siebten Himmel|être aux anges|NQ
st|pa||kick the bucket|beißen ^ ins Gras|casser POSS pipe|Q
st|of||cost an arm and a leg|kosten ^ ein Vermögen|coûter les yeux de la tête|Q
st|it||be raining cats and dogs|regnen ^ in Strömen|pleuvoir des cordes|Q
st|p||go home|gehen ^ nach Hause|rentrer à la maison|NFQ
go|pa|l:g|go to {D}|gehen ^ {D}|aller à {D}|NFQ
say|p||say|sagen|dire|
say|p||think|glauben|penser|
say|p||know|wissen|savoir|"""
_PRONOUNS = [("I", "ich", "je", 0, "m"), ("you", "du", "tu", 1, "m"), ("he", "er", "il", 2, "m"),
             ("she", "sie", "elle", 2, "f"), ("we", "wir", "nous", 3, "m"), ("they", "sie", "ils", 5, "m"),
             ("it", "es", "il", 2, "m")]
_NUMBERS = {n: w for n, w in zip(range(2, 13), zip(
    "two three four five six seven eight nine ten eleven twelve".split(),
    "zwei drei vier fünf sechs sieben acht neun zehn elf zwölf".split(),
    "deux trois quatre cinq six sept huit neuf dix onze douze".split()))}
_TIME_ADVS = [tuple(a.strip().split("|")) for a in """today|heute|aujourd'hui; now|jetzt|maintenant;
    in the morning|am Morgen|le matin; in the evening|am Abend|le soir; at night|nachts|la nuit;
    every day|jeden Tag|chaque jour; on Sunday|am Sonntag|le dimanche; on Monday|am Montag|le lundi;
    in winter|im Winter|en hiver; in summer|im Sommer|en été; sometimes|manchmal|parfois;
    unfortunately|leider|malheureusement; at the weekend|am Wochenende|le week-end;
    after school|nach der Schule|après l'école""".split(";")]
_FREQ_ADVS = [tuple(a.split("|")) for a in "often|oft|souvent;always|immer|toujours;rarely|selten|rarement".split(";")]
# Locative prepositions: en | de (+dative) | fr | noun flag.
_PREPS = [tuple(p.split("|")) for p in "in|in|dans|I; on|auf|sur|O; under|unter|sous|U; in front of|vor|devant|F; "
          "behind|hinter|derrière|F; next to|neben|à côté de|F; near|in der Nähe von|près de|F".split("; ")]
_WITH = ("with", "mit", "avec", "")
# Links: en | de | fr | kind (co = coordination, sub = subordination) | commas before it in en,de,fr.
_LINKS = [tuple(l.split("|")) for l in ("and|und|et|co|000", "but|aber|mais|co|111", "because|weil|parce que|sub|010",
                                        "when|wenn|quand|sub|010", "while|während|pendant que|sub|010",
                                        "if|falls|si|sub|010")]

# German declension: index [case][gender-or-pl]; case 0 nominative, 1 accusative, 2 dative.
_DE_DEF = [dict(m="der", f="die", n="das", pl="die"), dict(m="den", f="die", n="das", pl="die"),
           dict(m="dem", f="der", n="dem", pl="den")]
_DE_EIN = [dict(m="ein", f="eine", n="ein", pl="keine"), dict(m="einen", f="eine", n="ein", pl="keine"),
           dict(m="einem", f="einer", n="einem", pl="keinen")]
_DE_JED = [dict(m="jeder", f="jede", n="jedes"), dict(m="jeden", f="jede", n="jedes"),
           dict(m="jedem", f="jeder", n="jedem")]
_DE_END = {decl: [dict(zip(("m", "f", "n", "pl"), case.split())) for case in spec.split(" | ")] for decl, spec in (
    ("weak", "e e e en | en e e en | en en en en"), ("mixed", "er e es en | en e es en | en en en en"),
    ("strong", "er e es e | en e es e | em er em en"))}
_DE_IRREG = {"sein": "bin bist ist sind seid sind", "haben": "habe hast hat haben habt haben",
             "mögen": "mag magst mag mögen mögt mögen", "wissen": "weiß weißt weiß wissen wisst wissen"}
_DE_REFL = "mich dich sich uns euch sich".split()
_DE_CONTRACT = {("in", "dem"): "im", ("an", "dem"): "am", ("von", "dem"): "vom", ("zu", "dem"): "zum",
                ("zu", "der"): "zur", ("in", "das"): "ins", ("an", "das"): "ans", ("bei", "dem"): "beim"}
_DE_GO = {"i": ("in", 1), "a": ("an", 1), "z": ("zu", 2), "u": ("auf", 1)}
_FR_IRREG = {k.strip(): v.split() for k, v in (e.split(":") for e in """être:suis es est sommes êtes sont;
    avoir:ai as a avons avez ont; aller:vais vas va allons allez vont; voir:vois vois voit voyons voyez voient;
    boire:bois bois boit buvons buvez boivent; lire:lis lis lit lisons lisez lisent;
    suivre:suis suis suit suivons suivez suivent; tenir:tiens tiens tient tenons tenez tiennent;
    ouvrir:ouvre ouvres ouvre ouvrons ouvrez ouvrent;
    écrire:écris écris écrit écrivons écrivez écrivent; prendre:prends prends prend prenons prenez prennent;
    dormir:dors dors dort dormons dormez dorment; courir:cours cours court courons courez courent;
    rire:ris ris rit rions riez rient; sourire:souris souris sourit sourions souriez sourient;
    dire:dis dis dit disons dites disent; savoir:sais sais sait savons savez savent;
    pleuvoir:pleus pleus pleut pleuvons pleuvez pleuvent; acheter:achète achètes achète achetons achetez achètent;
    appeler:appelle appelles appelle appelons appelez appellent""".split(";"))}
_FR_REFL = "me te se nous vous se".split()
_FR_POSS = "ma ta sa notre votre leur".split()
_FR_ELIDE = {"le", "la", "de", "ne", "je", "me", "te", "se", "que"}
_FR_CONTRACT = {("à", "le"): "au", ("à", "les"): "aux", ("de", "le"): "du", ("de", "les"): "des"}
_VOWELS = "aeiouyéèêàâîôûœh"


@dataclass(frozen=True)
class Noun:
    cat: str
    en: tuple[str, str]
    de_g: str
    de: tuple[str, str]
    fr_g: str
    fr: tuple[str, str]
    flags: str


@dataclass(frozen=True)
class Adj:
    en: str
    de: str
    de_stem: str  # inflecting stem, "" = invariable
    fr: tuple[str, str, str, str]  # masc sg, fem sg, masc pl, fem pl
    fr_mv: str  # masculine singular before a vowel ("bel")
    fr_pre: bool
    cats: str


@dataclass(frozen=True)
class Frame:
    kind: str
    subj: str
    obj: str
    en: str
    de: str
    fr: str
    opts: str


def _en_plural(w: str) -> str:
    if w.endswith(("s", "sh", "ch", "x")):
        return w + "es"
    return w[:-1] + "ies" if w.endswith("y") and w[-2] not in "aeiou" else w + "s"


def _fr_forms(spec: str) -> tuple[str, str, str, str]:
    f = spec.replace("_", " ").split("/")
    ms = f[0]
    fs = f[1] if len(f) > 1 else (ms if ms.endswith("e") else ms + "e")
    mp = f[2] if len(f) > 2 else (ms if ms.endswith(("s", "x")) else ms + "s")
    return ms, fs, mp, f[3] if len(f) > 3 else fs + "s"


def _parse_nouns() -> list[Noun]:
    nouns = []
    for cat, text in _NOUNS.items():
        for entry in text.split(";"):
            en, de, fr, *rest = entry.replace("_", " ").split()
            en_sg, _, en_pl = en.partition("/")
            (de_g, de_w), (fr_g, fr_w) = de.split(":"), fr.split(":")
            de_sg, _, de_pl = de_w.partition("/")
            fr_sg, _, fr_pl = fr_w.partition("/")
            if not fr_pl:
                fr_pl = fr_sg if fr_sg.endswith(("s", "x")) else fr_sg[:-2] + "aux" if fr_sg.endswith("al") else \
                    fr_sg + ("x" if fr_sg.endswith("eau") else "s")
            flags = rest[0] if rest else ""
            flags += "g" if any(c in flags for c in _DE_GO) else ""
            nouns.append(Noun(cat, (en_sg, en_pl or _en_plural(en_sg)), de_g, (de_sg, de_pl or de_sg), fr_g,
                              (fr_sg, fr_pl), flags))
    return nouns


def _parse_adjs(text: str) -> list[Adj]:
    out = []
    for entry in text.split(";"):
        en, de, fr, *rest = entry.split()
        de_word, eq, stem = de.partition("=")
        fr_spec, _, mv = fr.partition("|")
        forms = _fr_forms(fr_spec)
        stem = stem if eq else de_word[:-1] if de_word.endswith("e") else de_word  # müde -> müd-e
        out.append(Adj(en, de_word, stem, forms, mv or forms[0], "b" in rest[1:], rest[0] if rest else ""))
    return out


NOUNS, ADJS, COLOURS = _parse_nouns(), _parse_adjs(_ADJS), _parse_adjs(_COLOURS)
_ADJ_BY_CAT = {c: [a for a in ADJS if c in a.cats] for c in _NOUNS}
_PLACE_ADJS = _ADJ_BY_CAT["l"]
FRAMES = [Frame(*line.split("|")) for line in _FRAMES.splitlines()]
_FRAMES_BY_KIND = {(k, q): [f for f in FRAMES if f.kind == k and (not q or "Q" in f.opts)]
                   for k in ("tr", "in", "cop", "st", "go", "say") for q in (False, True)}


def lookup(en: str, table: str = "noun") -> Noun | Adj | Frame | tuple[str, ...]:
    """A lexicon entry by its English form; table: noun, adj, colour, frame, link, time, freq or prep."""
    items: list = {"noun": NOUNS, "adj": ADJS, "colour": COLOURS, "frame": FRAMES, "link": _LINKS,
                   "time": _TIME_ADVS, "freq": _FREQ_ADVS, "prep": _PREPS + [_WITH]}[table]
    for item in items:
        if (item.en[0] if isinstance(item, Noun) else item[0] if isinstance(item, tuple) else item.en) == en:
            return item
    raise KeyError(f"no {table} {en!r}")


# ---------------------------------------------------------------------------------------------- meaning
@dataclass(frozen=True)
class NP:
    """A noun phrase (or a pronoun, ``noun=None``); det: def, indef, mass, every, num, many, few."""
    noun: Noun | None = None
    pron: int = 0
    det: str = "def"
    plural: bool = False
    num: int = 0
    adj: Adj | None = None
    colour: Adj | None = None
    conj: NP | None = None


@dataclass(frozen=True)
class Clause:
    """One predicate (a ``Frame``) with its arguments and modifiers."""
    frame: Frame
    subj: NP
    obj: NP | None = None  # object or destination
    num: int = 0  # age
    adj: Adj | None = None  # predicative adjective
    neg: bool = False
    adv: tuple[str, ...] | None = None  # (en, de, fr)
    freq: bool = False  # adv is a frequency adverb (placed next to the verb)
    front: bool = False  # adv is fronted (German: verb second)
    pp: tuple[tuple[str, ...], NP] | None = None
    like: bool = False
    comp: Clause | None = None  # "says that ..."


@dataclass(frozen=True)
class Sentence:
    """A main clause with an optional fronted subordinate clause and up to two linked clauses, or a question."""
    main: Clause
    front_sub: tuple[tuple[str, ...], Clause] | None = None
    tail: tuple[tuple[tuple[str, ...], Clause], ...] = ()
    question: bool = False


def _agr(np: NP) -> tuple[int, str]:
    """(person 0..5, French gender) of a subject."""
    if np.noun is None:
        return _PRONOUNS[np.pron][3], _PRONOUNS[np.pron][4]
    if np.conj is not None:
        return 5, "m" if "m" in (np.noun.fr_g, np.conj.noun.fr_g) else "f"  # type: ignore[union-attr]
    return (5 if np.plural else 2), np.noun.fr_g


# ---------------------------------------------------------------------------------------------- English
def _en_np(np: NP) -> list[str]:
    if np.noun is None:
        return [_PRONOUNS[np.pron][0]]
    det = {"def": ["the"], "indef": [] if np.plural else ["a"], "mass": [], "every": ["every"],
           "many": ["a", "lot", "of"], "few": ["a", "few"], "num": [_NUMBERS.get(np.num, ("",))[0]]}[np.det]
    out = det + [a.en for a in (np.adj, np.colour) if a] + [np.noun.en[np.plural]]
    return out + ["and"] + _en_np(np.conj) if np.conj else out


def _en_verb(v: str, person: int) -> str:
    if v == "be":
        return ("am", "are", "is")[min(person, 2)] if person < 3 else "are"
    if person != 2:
        return v
    return "has" if v == "have" else v + "es" if v.endswith(("s", "sh", "ch", "x", "o")) else _en_plural(v)


def _en_clause(c: Clause, mode: str) -> list[str]:
    verb, *rest = c.frame.en.split()
    if c.like:
        verb, rest = "like", ["to", verb] + rest
    subs = {"{O}": c.obj and _en_np(c.obj), "{D}": c.obj and _en_np(c.obj), "ADJ": c.adj and [c.adj.en],
            "{N}": [_NUMBERS.get(c.num, ("",))[0]]}
    rest = [w for t in rest for w in (subs[t] if t in subs else [t])]
    person = _agr(c.subj)[0]
    subj, adv = _en_np(c.subj), list(c.adv[0].split()) if c.adv else []
    freq = adv if c.freq else []
    if mode == "q":
        head = [_en_verb("be" if verb == "be" else "do", person)] + subj + freq + ([] if verb == "be" else [verb])
    elif verb == "be":
        head = subj + [_en_verb("be", person)] + (["not"] if c.neg else []) + freq
    elif c.neg:
        head = subj + [_en_verb("do", person), "not", verb]
    else:
        head = subj + freq + [_en_verb(verb, person)]
    out = head + rest + ([c.pp[0][0]] + _en_np(c.pp[1]) if c.pp else [])
    if c.adv and not c.freq and not c.front:
        out += adv
    return out + (["that"] + _en_clause(c.comp, "sub") if c.comp else [])


# ---------------------------------------------------------------------------------------------- German
def _de_np(np: NP, case: int, kein: bool = False) -> list[str]:
    if np.noun is None:
        return [_PRONOUNS[np.pron][1]]
    n, key = np.noun, "pl" if np.plural else np.noun.de_g
    noun = n.de[np.plural]
    if np.plural and case == 2 and not noun.endswith(("n", "s")):
        noun += "n"
    det, art = np.det, []
    if det == "def":
        art, decl = [_DE_DEF[case][key]], "weak"
    elif det in ("indef", "mass") and kein:
        art, decl = ["k" + _DE_EIN[case][key] if key != "pl" else _DE_EIN[case][key]], "mixed"
    elif det == "indef" and not np.plural:
        art, decl = [_DE_EIN[case][key]], "mixed"
    elif det == "every":
        art, decl = [_DE_JED[case][key]], "weak"
    else:
        decl = "strong"
        art = {"num": [_NUMBERS.get(np.num, ("", ""))[1]], "few": ["ein", "paar"],
               "many": [("vielen" if case == 2 else "viele") if np.plural else "viel"]}.get(det, [])
    adjs = [a.de_stem + _DE_END[decl][case][key] if a.de_stem else a.de for a in (np.adj, np.colour) if a]
    out = art + adjs + [noun]
    return out + ["und"] + _de_np(np.conj, case) if np.conj else out


def _de_conj(spec: str, p: int) -> str:
    inf, _, irr = spec.partition(":")
    if inf in _DE_IRREG:
        return _DE_IRREG[inf].split()[p]
    if p in (3, 5):
        return inf
    stem = inf[:-2] if inf.endswith("en") else inf[:-1]
    if p == 0:
        return stem[:-2] + "le" if inf.endswith("eln") else stem + "e"
    if irr and p in (1, 2):
        if p == 1:
            return irr + ("t" if irr.endswith(("s", "ß", "z")) else "st")
        return irr if irr.endswith("t") else irr + "t"
    if stem.endswith(("t", "d", "chn", "ffn", "gn")):
        return stem + ("est" if p == 1 else "et")
    return stem + ("t" if p == 1 and stem.endswith(("s", "ß", "z", "x")) else "st" if p == 1 else "t")


def _de_clause(c: Clause, mode: str) -> list[str]:
    vspec, *tmpl = c.frame.de.split()
    if c.like:
        tmpl = ["^", "gern"] + [t for t in tmpl if t != "^"]
    person = _agr(c.subj)[0]
    particle = tmpl.pop()[:-1] if tmpl and tmpl[-1].endswith("+") else ""
    rest: list[str] = [_DE_REFL[person]] if tmpl[:1] == ["SICH"] else []  # reflexive first in the middle field
    tmpl = tmpl[len(rest):]
    rest += c.adv[1].split() if c.adv and not c.front else []
    skip_neg = False
    for i, t in enumerate(tmpl):
        if t.startswith("{O:"):
            kein = c.neg and c.obj.det in ("indef", "mass") and tmpl[i + 1:i + 2] == ["^"]  # type: ignore[union-attr]
            skip_neg |= kein
            rest += _de_np(c.obj, 1 if t == "{O:a}" else 2, kein)  # type: ignore[arg-type]
        elif t == "^":
            rest += ["nicht"] if c.neg and not skip_neg else []
        elif t.startswith("#"):
            g, noun = t[1:].split(":")
            rest += ["k" + _DE_EIN[1][g], noun] if c.neg else [noun]
        elif t == "{D}":
            prep, case = _DE_GO[next(f for f in c.obj.noun.flags if f in _DE_GO)]  # type: ignore[union-attr]
            rest += [prep] + _de_np(c.obj, case)  # type: ignore[arg-type]
        else:
            rest += {"ADJ": [c.adj.de if c.adj else ""], "{N}": [_NUMBERS.get(c.num, ("", ""))[1]]}.get(t, [t])
    if c.pp:
        rest += c.pp[0][1].split() + _de_np(c.pp[1], 2)
    subj, verb = _de_np(c.subj, 0), _de_conj(vspec, person)
    if mode == "sub":
        out = subj + rest + [particle + verb]
    else:
        head = subj + [verb] if mode == "main" else [verb] + subj
        out = head + rest + ([particle] if particle else [])
    return out + ([",", "dass"] + _de_clause(c.comp, "sub") if c.comp else [])


# ---------------------------------------------------------------------------------------------- French
def _fr_adj(a: Adj, g: str, plural: bool) -> str:
    return a.fr[(g == "f") + 2 * plural]


def _fr_np(np: NP, neg_de: bool = False, after_de: bool = False) -> list[str]:
    if np.noun is None:
        return [_PRONOUNS[np.pron][2]]
    n, g, pl = np.noun, np.noun.fr_g, np.plural
    noun = n.fr[pl]
    pre = [a for a in (np.adj,) if a and a.fr_pre]
    post = [a for a in (np.colour, np.adj) if a and not a.fr_pre]
    pre_w = [a.fr_mv if g == "m" and not pl and noun[0] in _VOWELS else _fr_adj(a, g, pl) for a in pre]
    art = {"def": ["les" if pl else "le" if g == "m" else "la"], "every": ["chaque"], "many": ["beaucoup", "de"],
           "few": ["quelques"], "num": [_NUMBERS.get(np.num, ("", "", ""))[2]],
           "indef": [("de" if pre else "des") if pl else "un" if g == "m" else "une"],
           "mass": ["de", "le" if g == "m" else "la"]}[np.det]
    if neg_de and np.det in ("indef", "mass"):
        art = ["de"]
    elif after_de and (np.det == "mass" or (np.det == "indef" and pl)):
        art = []
    out = art + pre_w + [noun] + [_fr_adj(a, g, pl) for a in post]
    return out + ["et"] + _fr_np(np.conj) if np.conj else out


def _fr_conj(inf: str, p: int) -> str:
    if inf in _FR_IRREG:
        return _FR_IRREG[inf][p]
    if inf.endswith("dre"):
        return inf[:-2] + ("s", "s", "", "ons", "ez", "ent")[p]
    stem = inf[:-2]
    if p == 3 and stem[-1] in "gc":
        stem = stem + "e" if stem[-1] == "g" else stem[:-1] + "ç"
    return stem + ("e", "es", "e", "ons", "ez", "ent")[p]


def _fr_clause(c: Clause, mode: str) -> list[str]:
    tmpl = c.frame.fr.split()
    person, g = _agr(c.subj)
    plural = person >= 3
    refl = [_FR_REFL[person] for t in tmpl if t == "SE"]
    vinf, *tmpl = [t for t in tmpl if t != "SE"]
    if c.like:
        vinf, tmpl = "aimer", [vinf] + tmpl
    rest: list[str] = []
    for i, t in enumerate(tmpl):
        prev = tmpl[i - 1] if i else ""
        if t in ("{O}", "{D}"):
            direct = prev not in ("à", "de")  # negated direct objects take "pas de"
            rest += _fr_np(c.obj, neg_de=c.neg and direct, after_de=prev == "de")  # type: ignore[arg-type]
        elif t.startswith("~"):
            rest.append(_fr_forms(t[1:])[(g == "f") + 2 * plural])
        else:
            rest += {"ADJ": [_fr_adj(c.adj, g, plural) if c.adj else ""], "POSS": [_FR_POSS[min(person, 5)]],
                     "{N}": [_NUMBERS.get(c.num, ("", "", ""))[2]]}.get(t, [t])
    verb = _fr_conj(vinf, person)
    out = _fr_np(c.subj) + (["ne"] if c.neg else []) + refl + [verb] + (["pas"] if c.neg else [])
    out += (c.adv[2].split() if c.adv and c.freq else []) + rest
    if c.pp:
        out += c.pp[0][2].split() + _fr_np(c.pp[1])
    if c.adv and not c.freq and not c.front:
        out += c.adv[2].split()
    out = (["est-ce", "que"] if mode == "q" else []) + out
    return out + (["que"] + _fr_clause(c.comp, "sub") if c.comp else [])


# ---------------------------------------------------------------------------------------------- sentences
def _postprocess(toks: list[str], lang: str) -> list[str]:
    """English a/an, German preposition+article contractions, French elision then contraction."""
    if lang == "en":
        return ["an" if t == "a" and nxt[0] in "aeiou" else t for t, nxt in zip(toks, toks[1:] + ["."])]
    out: list[str] = []
    if lang == "fr":
        for t in toks:
            if out and ((out[-1] in _FR_ELIDE and t[0] in _VOWELS and t not in ("huit", "onze"))
                        or (out[-1] == "si" and t in ("il", "ils"))):
                out[-1] = out[-1][:-1] + "'" + t
            else:
                out.append(t)
        toks, out = out, []
    table = _DE_CONTRACT if lang == "de" else _FR_CONTRACT
    for t in toks:
        if out and (out[-1], t) in table:
            out[-1] = table[out[-1], t]
        else:
            out.append(t)
    return out


_CLAUSE = {"en": _en_clause, "de": _de_clause, "fr": _fr_clause}


def realise(s: Sentence, lang: str) -> str:
    """Render a meaning in one language (capitalised, with final punctuation)."""
    if lang not in _CLAUSE:
        _check_langs([lang])
    clause = _CLAUSE[lang]
    li = SUPPORTED_LANGS.index(lang)
    toks: list[str] = []
    if s.question:
        toks = clause(s.main, "q")
    else:
        inverted = lang == "de"
        if s.front_sub:
            toks += s.front_sub[0][li].split() + clause(s.front_sub[1], "sub") + [","]
        elif s.main.adv and s.main.front:
            toks += s.main.adv[li].split() + ([] if lang == "de" else [","])
        else:
            inverted = False
        toks += clause(s.main, "inv" if inverted else "main")
        for link, c in s.tail:
            comma = [","] if link[4][li] == "1" else []
            toks += comma + link[li].split() + clause(c, "sub" if link[3] == "sub" else "main")
    toks = _postprocess([t for t in toks if t], lang)
    text = " ".join(toks).replace(" ,", ",")
    text += (" ?" if lang == "fr" else "?") if s.question else "."
    return text[0].upper() + text[1:]


# ---------------------------------------------------------------------------------------------- sampling
_POOLS: dict[str, list[Noun]] = {}


def _pool(spec: str) -> list[Noun]:
    if spec not in _POOLS:
        cats, _, flag = spec.partition(":")
        _POOLS[spec] = [n for n in NOUNS if n.cat in cats and (not flag or flag in n.flags)]
    return _POOLS[spec]


def _colourable(n: Noun) -> bool:
    return n.cat == "a" or "C" in n.flags


# Determiner distributions (names, cumulative weights); "+" marks plural.
_DETS = {"all": (("def", "indef", "def+", "indef+", "num", "many", "few", "every"), (42, 62, 72, 78, 86, 91, 95, 100)),
         "restricted": (("def", "indef", "def+"), (50, 70, 82)), "def": (("def",), (1,)),
         "pp": (("def", "indef", "def+"), (7, 9, 10)), "with": (("def", "indef"), (7, 10))}


def _sample_np(rng: random.Random, spec: str, *, pron: bool = False, restricted: bool = False,
               dets: str | None = None) -> NP:
    if pron and "p" in spec and rng.random() < 0.25:
        return NP(pron=rng.randrange(6))
    noun = rng.choice(_pool(spec))
    adjs = _ADJ_BY_CAT[noun.cat]
    adj = rng.choice(adjs) if adjs and rng.random() < 0.3 else None
    colour = rng.choice(COLOURS) if _colourable(noun) and rng.random() < 0.2 else None
    if noun.cat == "d":
        det = rng.choices(("def", "mass", "many"), cum_weights=(0.45, 0.85, 0.85 if restricted else 1.0))[0]
        return NP(noun, det=det, adj=adj)
    names, cum = _DETS[dets or ("restricted" if restricted else "all")]
    det = rng.choices(names, cum_weights=cum)[0]
    plural = det.endswith("+") or det in ("num", "many", "few")
    return NP(noun, det=det.rstrip("+"), plural=plural, num=rng.randint(2, 12) if det == "num" else 0,
              adj=adj, colour=colour)


def _sample_clause(rng: random.Random, depth: int, question: bool = False) -> Clause:
    kinds = ["tr", "in", "cop", "st", "go"] + (["say"] if depth == 0 and not question else [])
    kind = rng.choices(kinds, cum_weights=(42, 59, 72, 84, 90, 97)[:len(kinds)])[0]
    frame = rng.choice(_FRAMES_BY_KIND[kind, question])
    neg = "N" in frame.opts and not question and rng.random() < 0.15
    if frame.subj == "it":
        subj = NP(pron=6)
    elif rng.random() < 0.08:
        a = _sample_np(rng, frame.subj.replace("d", ""), dets="def")
        b = _sample_np(rng, a.noun.cat, dets="def")  # type: ignore[union-attr]
        subj = replace(a, conj=b) if b.noun != a.noun else a
    else:
        subj = _sample_np(rng, frame.subj.replace("d", "") if frame.kind != "cop" else frame.subj, pron=True,
                          restricted=neg)
        if subj.noun is not None and subj.noun.cat == "d":
            subj = NP(subj.noun, det="def", adj=None)
    obj = adj = None
    if frame.kind == "tr":
        obj = _sample_np(rng, frame.obj, restricted=neg)
    elif frame.kind == "go":
        obj = NP(rng.choice(_pool(frame.obj)), adj=rng.choice(_PLACE_ADJS) if rng.random() < 0.2 else None)
    elif frame.kind == "cop":
        cat = subj.noun.cat if subj.noun else "p"
        nouns = [n for n in (subj.noun, subj.conj and subj.conj.noun) if n]
        colourable = bool(nouns) and all(_colourable(n) for n in nouns)
        adj = rng.choice(_ADJ_BY_CAT[cat] + (COLOURS if colourable else []))
        if subj.noun is not None:  # no attributive adjective that could clash: not "the dirty map is clean"
            subj = replace(subj, adj=None, colour=None if adj in COLOURS else subj.colour,
                           conj=subj.conj and replace(subj.conj, adj=None, colour=None))
    adv, freq, front = None, False, False
    r = rng.random()
    if r < 0.1 and "F" in frame.opts and not neg:
        adv, freq = rng.choice(_FREQ_ADVS), True
    elif r < 0.3:
        adv, front = rng.choice(_TIME_ADVS), depth == 0 and not question and rng.random() < 0.4
    pp = None
    if "P" in frame.opts and rng.random() < 0.3:
        if (subj.noun is None or subj.noun.cat in "pa") and rng.random() < 0.2:
            pp = (_WITH, _sample_np(rng, "pa", dets="with"))
        else:
            prep = rng.choice(_PREPS)
            pp = (prep, _sample_np(rng, "ol:" + prep[3], dets="pp"))
    like = "L" in frame.opts and rng.random() < 0.25
    comp = _sample_clause(rng, depth + 1) if frame.kind == "say" else None
    return Clause(frame, subj, obj, rng.randint(2, 12), adj, neg, adv, freq, front, pp, like, comp)


def sample_meaning(rng: random.Random) -> Sentence:
    """Sample one language-independent meaning."""
    if rng.random() < 0.1:
        return Sentence(_sample_clause(rng, 0, question=True), question=True)
    main = _sample_clause(rng, 0)
    r, subs = rng.random(), [l for l in _LINKS if l[3] == "sub"]
    if r < 0.15 and main.frame.kind != "say":
        main = replace(main, front=False)
        return Sentence(main, front_sub=(rng.choice(subs), _sample_clause(rng, 1)))
    tail: list[tuple[tuple[str, ...], Clause]] = []
    if main.frame.kind != "say":
        for p in (0.5, 0.2):
            if rng.random() < p:
                tail.append((rng.choice(_LINKS), _sample_clause(rng, 1)))
            else:
                break
    return Sentence(main, tail=tuple(tail))


def _check_langs(langs: Sequence[str]) -> list[str]:
    bad = [l for l in langs if l not in SUPPORTED_LANGS]
    if bad or not langs:
        raise ValueError(f"unsupported language(s) {bad or list(langs)}; supported: {', '.join(SUPPORTED_LANGS)}")
    return list(langs)


def _iter_tuples(seed: int) -> Iterator[tuple[str, str, str]]:
    """Endless stream of (en, de, fr) renderings with 4..30 words in every language."""
    rng = random.Random(seed)
    while True:
        s = sample_meaning(rng)
        out = tuple(realise(s, lang) for lang in SUPPORTED_LANGS)
        if all(MIN_WORDS <= len(t.split()) <= MAX_WORDS for t in out):
            yield out  # type: ignore[misc]


def generate_sentences(n: int, seed: int, langs: Sequence[str] = DEFAULT_LANGS) -> list[tuple[str, ...]]:
    """n meaning-equivalent tuples, one string per language, deterministic for (n, seed, langs)."""
    idx = [SUPPORTED_LANGS.index(l) for l in _check_langs(langs)]
    return [tuple(t[i] for i in idx) for t in itertools.islice(_iter_tuples(seed), n)]


#: The order in which :func:`generate_corpus` takes the splits from the sentence stream: held-out splits first.
_DRAW_ORDER = ("test", "valid", "train")


CORPUS_MARKER = "corpus.json"  # what generate_corpus writes beside its files: the directory is one it may rewrite


def claim_corpus_dir(out: Path, splits: Iterable[str]) -> None:
    """A ValueError, before anything is written, where ``out`` holds ``SPLIT.LANG`` files that
    :func:`generate_corpus` would replace or delete but did not write (no :data:`CORPUS_MARKER`): the user's own, or
    a corpus of a version that wrote no marker (``force`` then)."""
    if not out.is_dir() or (out / CORPUS_MARKER).is_file():
        return
    theirs = [f"{split}.{lang}" for split in splits for lang in SUPPORTED_LANGS if (out / f"{split}.{lang}").exists()]
    if theirs:
        shown = ", ".join(theirs[:4]) + (f" and {len(theirs) - 4} more" if len(theirs) > 4 else "")
        raise ValueError(f"{out}: holds {shown}, which nmtflow corpus did not write (no {CORPUS_MARKER}); writing "
                         "the built-in corpus there would replace or delete them: give a new directory, or --force "
                         "if an earlier nmtflow corpus wrote them (before it left a corpus.json) (nothing was changed)")


def generate_corpus(out_dir: str | Path, langs: Sequence[str] = DEFAULT_LANGS, n_train: int = 20000,
                    n_valid: int = 500, n_test: int = 500, seed: int = 1234, *, force: bool = False) -> dict[str, int]:
    """Writes out_dir/{train,valid,test}.{lang} (UTF-8, one sentence per line, LF) and :data:`CORPUS_MARKER`;
    returns line counts per split. Splits must not share sentences (dedupe across splits by the source meaning), and
    no line is empty. A directory holding such files without the marker is refused unless ``force``.

    The held-out splits are drawn first (test, then valid, then train), so for a seed the test split depends only on
    ``n_test`` and the valid split on ``n_test`` and ``n_valid``: corpora that differ in ``n_train`` (a learning
    curve) share their held-out splits, their training splits are nested, and no held-out sentence of one is a
    training sentence of another."""
    idx = [SUPPORTED_LANGS.index(l) for l in _check_langs(langs)]
    if len(set(idx)) != len(idx):
        raise ValueError(f"duplicate language in {list(langs)}")
    sizes = {"train": n_train, "valid": n_valid, "test": n_test}
    for split, n in sizes.items():
        if n < (1 if split == "train" else 0):
            raise ValueError(f"--{split}: the number of {split} sentences must be >= {int(split == 'train')}, got {n}")
    out = Path(out_dir)
    if not force:  # force: out_dir is the caller's own (a comparison's OUT/corpus), or known to hold a corpus
        claim_corpus_dir(out, sizes)
    total, rows, seen = sum(sizes.values()), [], [set() for _ in SUPPORTED_LANGS]
    for tries, t in enumerate(_iter_tuples(seed)):
        if len(rows) == total:
            break
        if tries > 50 * total + 1000:
            raise ValueError(f"the built-in corpus could not draw {total:,} distinct sentences (found {len(rows):,} "
                             f"in {tries:,} draws): ask for fewer with --train/--valid/--test")
        if any(s in seen[i] for i, s in enumerate(t)):  # a sentence seen in any language is a duplicate
            continue
        for i, s in enumerate(t):
            seen[i].add(s)
        rows.append(t)
    out.mkdir(parents=True, exist_ok=True)
    (out / CORPUS_MARKER).write_text(json.dumps({"written_by": "nmtflow corpus", "langs": list(langs), "seed": seed,
                                                 **sizes}) + "\n", encoding="utf-8")  # first: a rerun may replace
    # another language's files of an earlier corpus in out_dir are not aligned with this one: removed, not left to
    # be prepared with it by mistake
    stale = [out / f"{split}.{lang}" for split in sizes for lang in SUPPORTED_LANGS
             if SUPPORTED_LANGS.index(lang) not in idx and (out / f"{split}.{lang}").is_file()]
    for path in stale:
        path.unlink()
    if stale:
        log.info("%s: removed %s of an earlier corpus (other languages)", out, ", ".join(p.name for p in stale))
    starts = dict(zip(_DRAW_ORDER, itertools.accumulate((sizes[s] for s in _DRAW_ORDER), initial=0)))
    for split, size in sizes.items():  # test.* written last (quickstart takes test.de as "the corpus is complete")
        for i in idx:
            text = "".join(r[i] + "\n" for r in rows[starts[split]:starts[split] + size])
            (out / f"{split}.{SUPPORTED_LANGS[i]}").write_text(text, encoding="utf-8", newline="\n")
    return dict(sizes)
