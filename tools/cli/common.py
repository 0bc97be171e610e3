"""What the commands share: logging, dtype names, clean exits, and a registered pair's models,
prompt format, data and artifact store."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer

DTYPES = ("float32", "float16", "bfloat16")


def setup_logging(verbose: bool, service: bool = False) -> None:
    """WARNING and above (INFO with ``verbose``); a ``service`` also logs its requests (``scd.access``,
    one line each, when its ``access_log`` setting is on) and stamps every line with the time."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format=("%(asctime)s " if service else "") + "%(levelname)s %(name)s: %(message)s")
    if service:
        from shared.metrics import ACCESS_LOG

        logging.getLogger(ACCESS_LOG).setLevel(logging.INFO)


def fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def finite(value: float | None) -> float | None:
    """A float option's callback: NaN and infinity are refused ("--timeout inf" became a deadline that
    had already passed; "--delay-ms nan" reached netem)."""
    import math

    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"takes a finite number, got {value}")
    return value


def finite_in(lo: float, hi: float | None = None):
    """A float option's callback: a finite number from ``lo`` (up to ``hi``). In place of typer's
    ``min``/``max``, which run first and said "Input should be greater than or equal to 0" for NaN."""

    def check(value: float | None) -> float | None:
        finite(value)
        if value is not None and not (lo <= value and (hi is None or value <= hi)):
            most = f" and less than or equal to {hi:g}" if hi is not None else ""
            raise typer.BadParameter(f"takes a finite number greater than or equal to {lo:g}{most}, got {value:g}")
        return value

    return check


def bearer_token(value: str | None) -> str | None:
    """``--token``'s callback: the token as a service reads its ``token_file`` (whitespace around it
    dropped: a secret file's newline), then printable ASCII without spaces, as gRPC metadata carries."""
    if value is None:
        return None
    from shared.rpc.security import sendable_token

    tok = value.strip()
    if not tok or not sendable_token(tok):
        raise typer.BadParameter("the bearer token must be non-empty printable ASCII without spaces (gRPC metadata "
                                 "carries no other): give the services' security.token")
    return tok


def name_list(value: str, option: str = "--methods") -> tuple[str, ...]:
    """A comma-separated option's names (spaces around them dropped); an empty list is refused."""
    names = tuple(dict.fromkeys(x.strip() for x in value.split(",") if x.strip()))
    if not names:
        raise typer.BadParameter(f"{option} needs at least one name (comma-separated), got {value!r}")
    return names


def known_methods(names, allow: tuple[str, ...] = ()) -> tuple[str, ...]:
    """``names`` when each is a registered transfer method (or in ``allow``, e.g. auto), else a usage
    error for --methods naming the others: before any model loads or service starts."""
    from shared.codecs import CODECS

    unknown = [m for m in names if m not in CODECS and m not in allow]
    if unknown:
        raise typer.BadParameter(f"unknown methods {unknown}; expected some of {sorted([*CODECS, *allow])}",
                                 param_hint="--methods")
    return tuple(names)


def _not_writable(path: Path, e: OSError) -> typer.BadParameter:
    """Why ``path`` cannot be written, naming a file that stands where a folder must be (the OS says
    only "File exists" or "Not a directory")."""
    for up in (path, *path.parents):
        if up.exists():
            if not up.is_dir() and up != path:
                return typer.BadParameter(f"{path} cannot be written: {up} is a file, not a folder")
            break
    return typer.BadParameter(f"{path} cannot be written: {e.strerror or e}")


def output_file(path: Path | None) -> Path | None:
    """An option's output file, checked before the work that fills it (a benchmark or evaluation can
    run for an hour): not a folder, its folder made, and writable. Used as a typer callback."""
    if path is None:
        return None
    if path.is_dir():
        raise typer.BadParameter(f"{path} is a folder; give a file name to write")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as e:
        raise _not_writable(path, e) from None
    return path


DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}
"""``--dtype``'s names, each to its torch dtype's name (``torch_dtype`` reads it; the CLI checks it
without importing torch)."""


def _device_name(value: str) -> str:
    """``--device`` checked when the command line is read (whether this machine has the device is
    checked where the models load): a typo fails before minutes of work, not after."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise typer.BadParameter(f"{value!r} is not a device; use cpu, cuda or cuda:N")
    return value


def _dtype_name(value: str) -> str:
    if value not in DTYPES:
        raise typer.BadParameter(f"{value!r}: expected one of {', '.join(DTYPES)}")
    return value


# the options several commands take, each with its help text once
Device = Annotated[str, typer.Option(callback=_device_name, help="Where the models run: cpu, cuda or cuda:N.")]
DType = Annotated[str, typer.Option(callback=_dtype_name, help="The models' dtype: float32 (fp32; on CPU), bfloat16 "
                                                               "(bf16) or float16 (fp16).")]
Verbose = Annotated[bool, typer.Option("-v", "--verbose", help="Log progress at INFO (default: warnings and errors).")]
JsonOut = Annotated[Optional[Path], typer.Option("--json", callback=output_file,
                                                 help="Also write the results to this JSON file.")]


def output_dir(path: Path | None) -> Path | None:
    """An option's output folder, made and checked writable before the work (``output_file``'s twin)."""
    if path is None:
        return None
    if path.exists() and not path.is_dir():
        raise typer.BadParameter(f"{path} is a file; give a folder to write into")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".scd-write-check"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise _not_writable(path, e) from None
    return path


def torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise typer.BadParameter(f"expected one of {sorted(DTYPES)}, got {name!r}")
    return getattr(torch, DTYPES[name])


def entry(pair: str):
    """The registered pair, or a clean exit naming the registered ones."""
    from shared.errors import SCDError
    from tools.assets import registry

    try:
        return registry.get(pair)
    except SCDError as e:
        fail(str(e))


def served_methods(store_dir: Path, name: str) -> list[str]:
    """What a store holds for consumer ``name``: the methods it can serve without more calibration."""
    from tools.assets.registry import uncalibrated

    check_store(store_dir)
    kinds = ("oracle", "raw", "quant", "scd-reuse", "scd", "spectrum", "droidspeak", "ridge")
    short = uncalibrated(kinds, store_dir, name)
    if "scd" in short:
        import shlex

        typer.echo(f"note: no SCD artifacts for consumer {name!r} in {store_dir} (run `scd calibrate --pair "
                   f"{shlex.quote(name)}`): scd is not served", err=True)
    return [k for k in kinds if k not in short]


@dataclass
class PairModels:
    """A registered pair loaded for an offline command: both models, the prompt format, the store."""

    entry: object  # registry.PairEntry
    producer: object  # ModelAdapter
    consumer: object  # ModelAdapter
    tok: object
    fmt: object  # PromptFormat

    @property
    def name(self) -> str:
        return self.entry.name

    def store(self, override: Path | None = None) -> Path:
        return check_store(Path(override) if override else self.entry.store_dir())


def check_store(path: Path) -> Path:
    """``path`` unless it is a file (a store may not exist yet: it is filled later)."""
    if path.exists() and not path.is_dir():
        fail(f"the artifact store {path} is a file; it names a folder (--store, SCD_STORE or the pair's store)")
    return path


def pair_trouble(e, err: object) -> str:
    """A registered pair's folders failed to load: the error, with how to make them whole again."""
    if e.builtin:
        return f"pair {e.name!r}: {err}; it is a built-in pair: `scd assets --pair {e.name}` makes its folders again"
    gone = [f for f in (e.producer, e.consumer, e.consumer_adapter, e.tokenizer) if f and not Path(f).exists()]
    hint = (f"; {', '.join(dict.fromkeys(gone))} moved or went since `scd pair add`: register the pair again with "
            f"`scd pair add {e.name} --producer DIR --consumer DIR (or --consumer-adapter DIR) --replace`"
            if gone else "")
    return f"pair {e.name!r}: {err}{hint}"


def pair_models(pair: str, device: str = "cpu", dtype: str = "float32") -> PairModels:
    """Load a registered pair (its weights checked against the registered fingerprints)."""
    from shared.errors import SCDError
    from shared.model.hf_adapter import ModelAdapter
    from shared.model.loading import load_model, load_tokenizer
    from shared.model.prompt import PromptFormat

    e = entry(pair)
    td = torch_dtype(dtype)
    try:
        producer = load_model(e.producer, device, td)
        folder, adapter = e.consumer_model()
        consumer = load_model(folder, device, td, adapter)
        tok = load_tokenizer(e.tokenizer)
    except (SCDError, OSError) as err:
        fail(pair_trouble(e, err))
    for side, model, want in (("producer", producer, e.producer_fingerprint), ("consumer", consumer,
                                                                               e.consumer_fingerprint)):
        if model.scd_fingerprint != want:
            fail(f"pair {pair!r}: the {side}'s weights changed since registration (fingerprint {model.scd_fingerprint}"
                 f", registered {want}); " + ("it is a built-in pair: `scd assets` makes its folders again"
                                               if e.builtin else f"run `scd pair add {pair} ... --replace` (and "
                                               "recalibrate)"))
    return PairModels(e, ModelAdapter(producer), ModelAdapter(consumer), tok, PromptFormat(tok))


def items(pm: PairModels, split: str | None, n: int | None = None, data_file: Path | None = None, kinds=("qa",)):
    """Prompts of ``split`` for the pair (None: every split, in file order): the operator's JSONL (its
    seeded split) when given, else the built-in data of ``kinds``, encoded with the pair's own
    tokenizer and chat template."""
    from tools import data
    from tools.data import user

    try:
        if data_file:
            return user.load(data_file, pm.fmt, split, n, max_tokens=getattr(pm.consumer.config,
                                                                              "max_position_embeddings", None))
        splits = data.SPLITS if split is None else (split,)
        out = [it for kind in kinds for it in (data.heldout_items(pm.fmt) if kind == "heldout"  # one split only
                                                else [x for s in splits for x in data.load(kind, s, fmt=pm.fmt)])]
        return out[:n] if n is not None else out
    except (user.DataFileError, FileNotFoundError, ValueError, UnicodeDecodeError) as e:
        entry = pm.entry  # an own pair's command may take the operator's prompts instead of the built-in ones
        own = data_file is None and isinstance(e, FileNotFoundError) and not getattr(entry, "builtin", True)
        fail(f"{e}" + (f" (the built-in prompts); or give pair {getattr(entry, 'name', '')!r} your own with "
                       "--data FILE (docs/byo.md)" if own else ""))


def check_data(data_file: Path | None, *needed: str, pair: str | None = None, any_split: bool = False) -> None:
    """Parse the operator's JSONL before any model is loaded: a bad file, or one with no prompt in a
    split the command ``needed``, fails in a second, not after the models load (the message names the
    file and line, or the splits' sizes). Given the registered ``pair``, every prompt is also encoded
    with its tokenizer and chat template (a template that refuses a line names it). ``any_split``:
    the command reads the file whole (``scd eval --split all``), so no split need hold a prompt."""
    if data_file is None:
        return
    from tools.data import user

    fmt = None
    if pair is not None:
        from shared.errors import SCDError
        from tools.assets import registry

        try:
            e = registry.get(pair)
        except SCDError:
            e = None  # the command says what is wrong with the pair
        if e is not None:
            from shared.model.loading import load_tokenizer
            from shared.model.prompt import PromptFormat

            try:
                fmt = PromptFormat(load_tokenizer(e.tokenizer))
            except SCDError as err:  # a registered folder moved or damaged since
                fail(pair_trouble(e, err))
    try:
        n = user.counts(data_file, fmt=fmt)
        for split in () if any_split else needed:
            if not n[split]:
                raise user.empty_split(data_file, split, n)  # type: ignore[arg-type]  # a split's name
    except (user.DataFileError, OSError, UnicodeDecodeError) as e:
        fail(str(e))
    typer.echo(f"data: {data_file}: {sum(n.values())} prompts ({', '.join(f'{k} {v}' for k, v in n.items())})",
               err=True)
    warning = None if any_split else user.few_prompts(data_file, n, needed)
    if warning:
        typer.echo(warning, err=True)


def calibration_prompts(pm: PairModels, data_file: Path | None) -> list[list[int]]:
    """Calibration prompts: the JSONL's calibration split, or built-in QA and LM interleaved."""
    if data_file:
        return [it.prompt_ids for it in items(pm, "calibration", data_file=data_file)]
    qa, lm = items(pm, "calibration", kinds=("qa",)), items(pm, "calibration", kinds=("lm",))
    return [x.prompt_ids for pair_ in zip(qa, lm) for x in pair_] + [x.prompt_ids for x in qa[len(lm):]]


def validation_items(pm: PairModels, data_file: Path | None, n: int | None = None) -> list:
    """Validation items (what calibration selects on): the JSONL's validation split, or built-in QA
    and LM interleaved, so a choice that helps one kind of text and hurts the other is seen."""
    if data_file:
        return items(pm, "validation", n, data_file)
    qa, lm = items(pm, "validation", kinds=("qa",)), items(pm, "validation", kinds=("lm",))
    return ([x for pair_ in zip(qa, lm) for x in pair_] + qa[len(lm):])[:n]


def validation_prompts(pm: PairModels, data_file: Path | None, n: int | None = None) -> list[tuple[list[int], int]]:
    """The validation items' (prompt ids, fixed-prefix length)."""
    return [(it.prompt_ids, it.prefix_len) for it in validation_items(pm, data_file, n)]


def parse_set(values: list[str]) -> dict:
    """``--set key=value`` flags as a dict (values read as YAML: ``shared.config.override_value``)."""
    from shared.config import override_value

    out = {}
    for item in values:
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise typer.BadParameter(f"--set {item!r} must look like key=value")
        out[k.strip()] = override_value(v)
    return out
