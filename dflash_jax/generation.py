"""Batch generation from JSONL rows: the library behind `python -m infer`,
`python -m train.generate_data` and the trainer's data regeneration.

    from dflash_jax.generation import GenerationJob, run_job

    result = run_job(GenerationJob(target="ckpt/qwen3-8b", drafter="ckpt/qwen3-8b-dflash",
                                   input="prompts.jsonl", output="out.jsonl", max_new_tokens=512))
    result.summary  # tau, acceptance histogram, tokens/s, ...

A `GenerationJob` is the whole description of a run (typed fields, the CLI's defaults, checked
when it is made: a bad field is an `InputError` naming it by its CLI flag). `run_job` reads the
prompts (`input_ids`, `prompt`, `messages` or `turns`, optional `id` and `max_new_tokens`),
appends one JSON line per row to `output` as rows finish (stdout without one) and returns a
`GenerationResult` whose summary holds tau, the acceptance histogram and tokens/s (with
`compare_baseline` the baseline's tokens/s and the speedup). Rerunning with the same output skips
the ids already written. Flags, the readable terminal output and the printed summary are the
CLI's (`infer.flags`, `infer.job_output`).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable

from dflash_jax.chat import encode_chat, encode_text, has_chat_template
from dflash_jax.engine.options import EngineOptions, resolve
from dflash_jax.engine.cycles import check_settings
from dflash_jax.engine.sampling import (check_max_new_tokens, check_seed, check_temperature, check_top_k,
                                        check_top_p)
from dflash_jax.engine.speculation import PRIOR_RATE, SPECULATION_MODES
from dflash_jax.errors import DFlashError, InputError, flag
from dflash_jax.pair import DEMO_DIR, ModelPair, engine_mesh, open_pair, pair_dirs

# `python -m infer`'s engine options: the engine's defaults, speculation the job's (`speculation_mode`).
JOB_ENGINE = EngineOptions(speculation=None)
_ENGINE_FIELDS = frozenset(f.name for f in fields(EngineOptions))


# --------------------------------------------------------------------------- the job


@dataclass(frozen=True)
class GenerationJob:
    """One batch generation run: what `python -m infer` does with these flags (the field
    `temperature` is `--temperature`, and so on; the same defaults), the engine's flags held in
    `options` (an `EngineOptions`: `--batch-size` is `options.batch_size`). With no target it
    runs the bundled demo pair on its prompts (and, with no input, compares with the baseline).
    Checked when made: a field out of range is an InputError naming its flag.

    `GenerationJob.of(**flags)` makes one from flat fields, the job's and the options' alike
    (`GenerationJob.of(target=..., input=..., batch_size=4)`), as the flags are."""

    target: str | Path | None = None  # HF or converted directory (None: the demo pair)
    drafter: str | Path | None = None  # DFlash drafter; None: plain decoding (the demo's, for the demo)
    input: str | Path | None = None  # prompts JSONL (None: the demo's prompts; required with a target)
    output: str | Path | None = None  # results JSONL, appended, resumed; None: stdout
    # The engine: max_new_tokens None: 256 (128 for the demo pair), also the most a row may ask for;
    # max_prompt_len None: the longest prompt, rounded up; speculation None: `speculation_mode`.
    options: EngineOptions = JOB_ENGINE
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    seed: int = 0  # seed of the sampling keys (per row and position)
    ignore_eos: bool = False  # do not stop at the stop tokens
    compare_baseline: bool = False  # also time plain decoding and report the speedup
    enable_thinking: bool = False  # enable_thinking=True for the chat template (Qwen3)
    overwrite: bool = False  # start the output over instead of resuming it
    quiet: bool = False  # no progress bar or progress messages

    @classmethod
    def of(cls, **flags) -> GenerationJob:
        """A job from flat fields: the job's own, and `EngineOptions`' (over `JOB_ENGINE`)."""
        engine = {k: v for k, v in flags.items() if k in _ENGINE_FIELDS}
        job = {k: v for k, v in flags.items() if k not in _ENGINE_FIELDS}
        options = replace(job.pop("options", JOB_ENGINE), **engine)
        return cls(**job, options=options)

    def __post_init__(self):
        """Checks that need no model, so a bad field fails before anything loads."""
        if self.target is None and self.drafter is not None:
            raise InputError("--drafter needs --target, the model it drafts for" + trained_against(Path(self.drafter)))
        if self.target is not None and not self.input:
            raise InputError("--input is required when --target is given")
        if not isinstance(self.options, EngineOptions):
            raise InputError(f"a job's options must be an EngineOptions, got {type(self.options).__name__}")
        o = self.options  # the rules a job's settings can be held to before its configs are read
        check_settings(o.block_size, o.draft_tokens, o.tree_budget, o.acceptance,
                       drafting=False if self.drafter_dir is None or o.block_size == 1 else None, names=flag)
        # What the engine casts to int32 or float32 is bounded here, before anything loads.
        check_temperature(self.temperature, "--temperature")
        check_top_p(self.top_p, "--top-p")
        check_top_k(self.top_k, "--top-k")
        check_seed(self.seed, "--seed")
        if self.options.max_new_tokens is not None:
            check_max_new_tokens(self.options.max_new_tokens, "--max-new-tokens")
        if self.output is not None and self.input_path.exists() and Path(self.output).exists() \
                and os.path.samefile(self.input_path, self.output):
            raise InputError(f"--output {self.output} is the input file: results would be appended to the prompts; "
                             f"choose another --output")

    @property
    def engine(self) -> EngineOptions:
        """The job's engine options, speculation settled (`speculation_mode`)."""
        return replace(self.options, speculation=self.speculation_mode)

    @property
    def demo_prompts(self) -> bool:
        """The demo pair on its own prompts (no --target, no --input): the README's first command."""
        return self.demo and self.input is None

    @property
    def speculation_mode(self) -> str:
        """--speculation, or its default: auto, except for the demo on its own prompts, which runs
        fixed (every cycle verifies the whole block: it shows DFlash, whose verify a CPU computes
        token by token, where auto would mostly decode plainly; its summary says what auto would do)."""
        if self.options.speculation is not None:
            return self.options.speculation
        return "fixed" if self.demo_prompts and self.options.block_size != 1 else SPECULATION_MODES[0]

    @property
    def demo(self) -> bool:
        """No target: the bundled demo pair."""
        return self.target is None

    @property
    def target_dir(self) -> Path:
        return pair_dirs(self.target, self.drafter)[0]

    @property
    def drafter_dir(self) -> Path | None:
        return pair_dirs(self.target, self.drafter)[1]

    @property
    def input_path(self) -> Path:
        return Path(self.input) if self.input else DEMO_DIR / "prompts.jsonl"

    def resolved(self) -> GenerationJob:
        """The job with its defaults that depend on others filled in: max_new_tokens (256; 128 for
        the demo pair), speculation (`speculation_mode`), and the demo on its own prompts compares
        with the baseline."""
        max_new = self.options.max_new_tokens
        max_new = max_new if max_new is not None else (128 if self.demo else 256)
        baseline = self.compare_baseline or (self.demo_prompts and self.options.block_size != 1)
        return replace(self, options=replace(self.engine, max_new_tokens=max_new), compare_baseline=baseline)


@dataclass(frozen=True)
class GenerationResult:
    """What `run_job` returns. summary: rows, errors (rows that could not run: their lines hold
    "error"; `python -m infer` then exits 4), tokens/s, tau, the acceptance histogram,
    block_size, draft_tokens, prompts (and baseline, speedup, note, heldout where they apply);
    None when every row was already in the output (nothing ran). skipped: rows already in the
    output. sample: the demo's first prompt and its completion, as text."""

    summary: dict | None
    skipped: int = 0
    sample: tuple[str, str] | None = None


# --------------------------------------------------------------------------- input


@dataclass
class InputRow:
    id: Any
    line: int
    kind: str  # input_ids | prompt | messages | turns
    value: Any
    position: int = 0  # index among the input's rows: keys the row's random stream
    max_new_tokens: int | None = None  # the row's own limit (None: the run's)
    sampling: dict = field(default_factory=dict)  # the row's own temperature / top_p / top_k (over the run's)
    fingerprint: str = ""  # of the input line (and, sampled, its position): what resume checks
    turn_ids: list[list[int]] = field(default_factory=list)  # prompt ids, one per turn so far
    turn_records: list[dict] = field(default_factory=list)  # finished turns of a `turns` row


PROMPT_KEYS = ("input_ids", "prompt", "messages", "turns")
SAMPLING_KEYS = ("temperature", "top_p", "top_k")
# A row's constraint (structured output), as the server's requests spell it (`dflash_jax.constrain.fields`).
CONSTRAINT_KEYS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice")
ROW_KEYS = PROMPT_KEYS + ("id", "max_new_tokens") + SAMPLING_KEYS + ("logit_bias",) + CONSTRAINT_KEYS


def edit_distance(a: str, b: str) -> int:
    """Damerau-Levenshtein distance (insertions, deletions, substitutions, swaps of neighbours)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[-1][-1]


def misspelt_key(key: str) -> str | None:
    """The row key `key` is one or two edits from (case aside; one edit for keys of up to five
    letters, and none for `id`, which too many metadata keys are near), or None."""
    for known in ROW_KEYS:
        if known == "id":
            continue
        if edit_distance(key.lower(), known) <= (1 if len(known) <= 5 else 2):
            return known
    return None


def _row_sampling(obj: dict, where: str) -> dict:
    out = {}
    for key in SAMPLING_KEYS:
        if key not in obj:
            continue
        value = obj[key]
        {"temperature": check_temperature, "top_p": check_top_p, "top_k": check_top_k}[key](value, f"{where}: {key}")
        out[key] = value
    if obj.get("logit_bias") is not None:  # {"token id": bias}, as the server takes it
        from dflash_jax.engine.sampling import Sampling, SamplingError

        bias = obj["logit_bias"]
        if not isinstance(bias, dict) or not all(isinstance(k, str) and k.isdigit() and len(k) < 12 for k in bias):
            raise InputError(f"{where}: logit_bias must map token ids (as strings) to numbers in -100..100")
        try:
            out["logit_bias"] = Sampling(logit_bias=tuple((int(k), v) for k, v in bias.items())).logit_bias
        except SamplingError as e:
            raise InputError(f"{where}: {e}") from None
    from dflash_jax.constrain.fields import constraint_of

    try:
        found = constraint_of(obj)
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    if found is not None:
        out["constraint"] = found[0]
    return out


def row_fingerprint(obj: dict) -> str:
    """A digest of an input line's object (its keys in any order)."""
    import hashlib

    text = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_rows(path: Path, warn=lambda message: None) -> list[InputRow]:
    """The rows of an input JSONL file (named in errors as given). A key one or two edits from a
    row key (`temprature`) is an error naming the key it may mean; other unknown keys (a row's
    metadata) are ignored, each named once through `warn`. A line with no prompt key but an
    unknown one names it (a misspelt `prompt`)."""
    from dflash_jax.data import iter_jsonl_objects

    rows, seen, unknown = [], set(), {}
    for n, obj in iter_jsonl_objects(path, InputError, "input file"):
        where = f"{path} line {n}"
        extra = [k for k in obj if k not in ROW_KEYS]
        for k in extra:
            meant = misspelt_key(k)
            if meant is not None:
                raise InputError(f"{where}: unknown key {k!r} (did you mean {meant!r}?)")
        kinds = [k for k in PROMPT_KEYS if k in obj]
        if len(kinds) != 1:
            has = f" (has {', '.join(kinds)})" if kinds else ""
            if not kinds and extra:
                has = f" (unknown key{'s' if len(extra) > 1 else ''} {', '.join(map(repr, extra))})"
            raise InputError(f"{where}: needs exactly one of {', '.join(PROMPT_KEYS)}{has}")
        for k in extra:
            unknown.setdefault(k, n)
        kind, value = kinds[0], obj[kinds[0]]
        if kind == "input_ids" and not (isinstance(value, list) and value
                                        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
            raise InputError(f"{where}: input_ids must be a non-empty list of integers")
        if kind == "prompt" and not isinstance(value, str):
            raise InputError(f"{where}: prompt must be a string")
        if kind == "messages" and not (isinstance(value, list) and value and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value)):
            raise InputError(f"{where}: messages must be a non-empty list of {{role, content}} strings")
        if kind == "turns" and not (isinstance(value, list) and value and all(isinstance(t, str) for t in value)):
            raise InputError(f"{where}: turns must be a non-empty list of strings")
        limit = obj.get("max_new_tokens")
        if limit is not None:
            check_max_new_tokens(limit, f"{where}: max_new_tokens")
        row_id = obj.get("id", n)
        if not isinstance(row_id, (str, int)) or isinstance(row_id, bool):
            raise InputError(f"{where}: id must be a string or an integer")
        if row_id in seen:
            raise InputError(f"{where}: duplicate id {row_id!r}")
        seen.add(row_id)
        rows.append(InputRow(row_id, n, kind, value, position=len(rows), max_new_tokens=limit,
                             sampling=_row_sampling(obj, where), fingerprint=row_fingerprint(obj)))
    for k, n in unknown.items():
        warn(f"warning: {path} line {n}: unknown key {k!r} ignored (keys: {', '.join(ROW_KEYS)})")
    return rows


def encode_prompt(row: InputRow, tokenizer, messages: list[dict] | None, thinking: bool) -> list[int]:
    """Token ids of a row's (current) prompt."""
    if row.kind == "input_ids":
        return list(row.value)
    if tokenizer is None:
        raise InputError(f"line {row.line}: '{row.kind}' needs a tokenizer, and the target has none")
    if row.kind == "prompt":
        return encode_text(tokenizer, row.value)
    if not has_chat_template(tokenizer):
        raise InputError(f"line {row.line}: '{row.kind}' needs a chat template, and the tokenizer has none")
    return encode_chat(tokenizer, messages, enable_thinking=thinking)


def prompt_budget(row: InputRow, tokenizer, thinking: bool, max_new_tokens: int) -> int:
    """Longest prompt this row will need: for `turns`, the last turn's prompt holds every
    earlier answer (at most max_new_tokens each, plus a little for re-tokenising text)."""
    if row.kind != "turns" or len(row.value) == 1:
        return len(row.turn_ids[0])
    conv = []
    for turn in row.value[:-1]:
        conv += [{"role": "user", "content": turn}, {"role": "assistant", "content": ""}]
    conv.append({"role": "user", "content": row.value[-1]})
    return len(encode_prompt(row, tokenizer, conv, thinking)) + (len(row.value) - 1) * (max_new_tokens + 8)


# --------------------------------------------------------------------------- output


# What a result depends on, by the flag that sets it: each output line records these (its
# "fingerprint", with the digest of its input line), and a rerun resumes only lines that match.
# Batch size, mesh, cache and page sizes, sync and tail settings change how rows run, not what
# they produce, and are not recorded.
SETTING_FLAGS = {"target": "--target", "drafter": "--drafter", "dtype": "--dtype", "block_size": "--block-size",
                 "draft_tokens": "--draft-tokens", "tree_budget": "--tree-budget", "acceptance": "--acceptance",
                 "max_new_tokens": "--max-new-tokens",
                 "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "seed": "--seed",
                 "ignore_eos": "--ignore-eos", "enable_thinking": "--enable-thinking"}


def model_digest(path: Path) -> str:
    """A digest of a model directory that reads no weight: its config.json, and the name and size
    of every other file (a copy of the same checkpoint elsewhere has the same digest)."""
    import hashlib

    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.name != "config.json"):
        h.update(f"{f.relative_to(path)}:{f.stat().st_size};".encode())
    return h.hexdigest()[:16]


class Resume:
    """What an existing output file holds of this run. Every line must be a result of this very
    run: its id a row of the input, made from the same input line (and, sampled, the same row
    position, which keys its random stream) and with the same settings. Those rows are `done`
    (a line holding an error is retried); anything else is an InputError naming the line and
    the setting that differs, before a model loads. A torn last line (an interrupted write) is
    cut off. A row's result must be its last line (a row whose line holds an error is retried,
    its new line appended): a line after it with the same id is an InputError naming both lines
    (two runs that wrote one output at once)."""

    def __init__(self, path: Path, rows: list[InputRow], keys: dict, settings: dict, input_path: Path):
        self.done: set = set()
        if not path.is_file():
            return
        data = path.read_bytes()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            with open(path, "r+b") as f:
                f.truncate(keep)
        by_id = {r.id: r for r in rows}
        results: dict = {}  # row id -> the line of its result
        again = "pass --overwrite to start it over, or choose another --output"
        for n, line in enumerate(data[:keep].splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path} line {n}"
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise InputError(f"{where} is not a JSON line: {path} is not an output of this tool; {again}") from None
            if not isinstance(obj, dict) or "id" not in obj or not isinstance(obj.get("fingerprint"), dict):
                raise InputError(f"{where} has no fingerprint (written by another tool or an older dflash-jax), so "
                                 f"it cannot be checked against this run; {again}")
            row, fp = by_id.get(obj["id"]), obj["fingerprint"]
            if row is None:
                raise InputError(f"{where}: id {obj['id']!r} is not a row of {input_path}: the output holds another "
                                 f"job's results; {again}")
            for key, option_flag in SETTING_FLAGS.items():
                if fp.get(key) == settings[key]:
                    continue
                if key in ("target", "drafter"):
                    other = "no drafter" if fp.get(key) is None else (
                        f"another {key} (its config or files differ from {option_flag}'s)" if settings[key] else f"a {key}")
                    raise InputError(f"{where}: id {row.id!r} was generated with {other}; {again}")
                was, now = (0 if key == "tree_budget" and v is None else v for v in (fp.get(key), settings[key]))
                raise InputError(f"{where}: id {row.id!r} was generated with {option_flag} {json.dumps(was)}, "
                                 f"this run has {json.dumps(now)}; {again}")  # (a tree budget of None: the chain, 0)
            if fp.get("input") != keys[row.id]:
                raise InputError(f"{where}: id {row.id!r} was generated from another row than {input_path} line "
                                 f"{row.line} (its prompt, limits or position differ); {again}")
            if row.id in results:
                raise InputError(f"{path} lines {results[row.id]} and {n} both hold the row of id {row.id!r} (two runs "
                                 f"wrote this output at once?): remove one of them, or {again}")
            if "error" not in obj:
                self.done.add(row.id)
                results[row.id] = n


class OutputLock:
    """A run's hold on its output file, so that two runs never append to one output: an
    exclusive `flock` on a lock file beside it (OUTPUT.lock, holding the holder's pid), taken
    before the output is read for resuming and kept until the run ends, then the lock file is
    removed. A second run on the same output gets an InputError naming the first one's pid. A
    run that is killed leaves the lock file behind, but not its lock: the next run takes it.
    path None (stdout, or not process 0): nothing is locked."""

    def __init__(self, path: Path | None):
        self.fd = None
        if path is None:
            return
        import fcntl

        check_output_path(path)
        self.path = path.with_name(path.name + ".lock")
        fd = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # the output may name a new directory
            while True:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                    os.close(fd)
                    fd = None
                    raise InputError(f"{path} is being written by another run (pid {pid}); wait for it to end, "
                                     f"or choose another --output") from None
                try:  # the holder may have removed the file between our open and our lock: lock the new one
                    current = os.stat(self.path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    current = False
                if current:
                    break
                os.close(fd)
                fd = None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            if fd is not None:
                os.close(fd)
            raise InputError(f"cannot write --output {path}: cannot create its lock file {self.path}: "
                             f"{e.strerror or e}") from None
        self.fd = fd

    def release(self):
        if self.fd is None:
            return
        try:  # removed while still locked: a run that opened it meanwhile sees it gone and retries
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class OutputWriteError(DFlashError):
    """A result line could not be written (a full disk): `python -m infer` exits 5. The lines
    written before it are kept, and a rerun with the same output resumes after them."""


class JsonlWriter:
    """Appends records as JSON lines, each flushed as it is written: to `path` (its directory
    created), or to stdout without one. `format` makes a record's text (the CLI's writer shows
    rows readably on a terminal). A write that fails is an OutputWriteError naming the file."""

    def __init__(self, path: str | Path | None):
        self.owned = bool(path)
        self.failed = False
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)  # the output may name a new directory
            self.file = open(path, "a", encoding="utf-8")
        else:
            self.file = sys.stdout
        self.name = str(path) if path else "stdout"

    def format(self, record: dict, row: InputRow | None) -> str:
        return json.dumps(record, ensure_ascii=False) + "\n"

    def write(self, record: dict, row: InputRow | None = None):
        try:
            self.file.write(self.format(record, row))
            self.file.flush()
        except OSError as e:
            self.failed = True
            raise OutputWriteError(write_failure(self.name, e, self.owned)) from None

    def close(self):
        if not self.owned:
            return
        try:
            self.file.close()
        except OSError as e:  # its buffer could not be flushed: the file is closed all the same
            if not self.failed:
                self.failed = True
                raise OutputWriteError(write_failure(self.name, e, True)) from None


def write_failure(name: str, e: OSError, resumable: bool) -> str:
    """The one line saying where results could not be written (and, for a file, that a rerun resumes)."""
    kept = "; the rows written are kept and a rerun resumes" if resumable else ""
    return f"could not write {name}: {e.strerror or e}{kept}"


class _NoWriter:
    """Where a process other than 0 writes (only process 0 of a multi-process run writes)."""

    def write(self, record: dict, row: InputRow | None = None):
        pass

    def close(self):
        pass


# --------------------------------------------------------------------------- the run

RecordMaker = Callable[[InputRow, dict, list | None], dict]


def run_job(job: GenerationJob, make_record: RecordMaker | None = None,
            writer: Callable[[Path | None], Any] = JsonlWriter) -> GenerationResult:
    """Run a generation job: rows are appended to `job.output` as they finish (rows already there,
    from the same input lines and settings, are skipped; see `Resume`) and the summary is returned,
    not printed. Bad input raises InputError (or another DFlashError) before a weight is read;
    rows that cannot run (a prompt longer than the context) are found then too, and written as
    {"id", "error"} lines while the others run.

    make_record(row, record, conversation) -> dict, if given, shapes each output line (its
    conversation: the chat messages a `messages`/`turns` row's last prompt was made of, else None;
    `train.generate_data` writes conversations with it). writer(path) opens what the lines go
    through (an object with write(record, row) and close(); default: JsonlWriter), on process 0
    only. Every line gets the row's "fingerprint" (`SETTING_FLAGS`).

    The steps: `plan_job` (rows, configs, resume: nothing loaded), the first turns encoded,
    `JobRun.screen` (rows that cannot run), `JobRun.load_engine` (weights, BatchEngine),
    `JobRun.decode` (every turn of every row), `JobRun.summary` (and the baseline).

    The output is locked for the run (`OutputLock`): a second run on the same output is an
    InputError naming the first one's pid. A write that fails (a full disk) is an
    OutputWriteError; the lines written before it are kept, and a rerun resumes."""
    import jax

    job = job.resolved()
    with OutputLock(Path(job.output) if job.output and jax.process_index() == 0 else None):
        return _run_job(job, make_record, writer)


def _run_job(job: GenerationJob, make_record: RecordMaker | None, writer: Callable[[Path | None], Any]):
    import jax

    from dflash_jax.engine import GenerationStats

    say = (lambda *a: None) if job.quiet else (lambda *a: print(*a, file=sys.stderr))
    plan = plan_job(job, say)
    if plan.demo_note:
        say(f"no --target given: running the bundled demo pair ({DEMO_DIR})")
    if plan.skipped and not plan.todo:
        # Nothing left: say so even when quiet (a resumed job's log should show why it did nothing),
        # and load no model.
        if jax.process_index() == 0:
            print(f"{plan.out_path}: all {plan.skipped} rows already done, nothing to generate", file=sys.stderr)
        return GenerationResult(None, skipped=plan.skipped)
    if plan.skipped:
        say(f"{plan.out_path}: {plan.skipped} of {plan.skipped + len(plan.todo)} rows already done (same input "
            f"lines and settings), skipping them")
    if plan.out_path is not None and jax.process_index() == 0:
        prepare_output(plan.out_path, job.overwrite)

    # Every row's first prompt is encoded before a weight is read: a row that cannot be fails fast.
    plan.pair.open_tokenizer(job.ignore_eos)
    run = JobRun(job, plan, say, make_record)
    run.encode_first_turns()
    run.out = writer(plan.out_path) if jax.process_index() == 0 else _NoWriter()
    try:
        max_prompt = run.screen()
        if not run.runnable:  # nothing to load or compile
            return GenerationResult({"rows": len(plan.todo), "errors": run.errors,
                                     **GenerationStats(plan.options.block_size).summary(),
                                     "draft_tokens": plan.settings["draft_tokens"] or 0}, skipped=plan.skipped)
        run.load_engine(max_prompt)
        run.decode()
    finally:
        run.out.close()
    return GenerationResult(run.summary(), skipped=plan.skipped,
                            sample=run.sample[1:] if run.sample is not None else None)


@dataclass
class JobPlan:
    """What a job will do, worked out from its input and the models' configs before a weight
    is read: the rows to run (those already in the output skipped), the pair (configs only), the
    engine's options settled for it, and the settings and input digests each output line records."""

    input_path: Path
    rows: list[InputRow]
    todo: list[InputRow]
    skipped: int
    pair: ModelPair
    options: EngineOptions  # the job's, settled for the pair (`resolve`): its block size, draft length, tree
    settings: dict
    keys: dict  # row id -> its input line's digest (and, sampled, its position)
    out_path: Path | None
    demo_note: bool  # no --target: say that the demo pair runs
    per_row: bool  # some rows set their own sampling


def plan_job(job: GenerationJob, say) -> JobPlan:
    """Read and check the rows and the pair's configs (no weight), and what the output already
    holds of this run (`Resume`). A resolved job; raises InputError."""
    input_path = job.input_path
    rows = read_rows(input_path, warn=say)
    if not rows:
        raise InputError(f"{input_path} holds no rows (one JSON object per line, each with one of "
                         f"{', '.join(PROMPT_KEYS)})")
    # Checked from the configs alone, before a weight is read or a program compiled.
    opts = job.options
    pair = open_pair(job.target, job.drafter, dtype=opts.dtype, use_drafter=opts.block_size != 1)
    for r in rows:
        bad = [t for t in [*(r.value if r.kind == "input_ids" else ()), *(t for t, _ in r.sampling.get("logit_bias", ()))]
               if not 0 <= t < pair.target.vocab_size]
        if bad:
            raise InputError(f"{input_path} line {r.line}: token id {bad[0]} is outside the target's vocabulary "
                             f"(0..{pair.target.vocab_size - 1})")
    for warning in pair.warnings if pair.drafting else ():
        say(f"warning: {warning}")
    if any("constraint" in r.sampling for r in rows):  # a pool for the rows' constraints (structured output)
        from dflash_jax.engine.constraints import DEFAULT_STATES

        opts = replace(opts, constraint_states=opts.constraint_states or DEFAULT_STATES)
    options = resolve(pair, opts)  # block size, draft length and tree checked against the pair
    block_size = options.block_size
    over = next((r for r in rows if r.max_new_tokens is not None and r.max_new_tokens > opts.max_new_tokens), None)
    if over is not None:
        raise InputError(f"{input_path} line {over.line}: max_new_tokens {over.max_new_tokens} is more than "
                         f"--max-new-tokens {opts.max_new_tokens}, which sizes the cache")

    # Resume: the output's rows must be this run's (same input lines, same settings).
    settings = {"target": model_digest(pair.target_dir),
                "drafter": model_digest(pair.drafter_dir) if pair.drafting else None,
                "dtype": pair.target.dtype, "block_size": block_size,
                "draft_tokens": (opts.draft_tokens or block_size - 1) if pair.drafting else None,
                # None for the chain, so outputs written before trees existed still resume
                "tree_budget": (opts.tree_budget or None) if pair.drafting else None,
                # only a DFlash2 drafter's sampled output depends on it (None otherwise, as before it existed)
                "acceptance": opts.acceptance if pair.drafting and pair.drafter.dflash2 is not None else None,
                "max_new_tokens": opts.max_new_tokens, "temperature": job.temperature, "top_p": job.top_p,
                "top_k": job.top_k, "seed": job.seed, "ignore_eos": job.ignore_eos,
                "enable_thinking": job.enable_thinking}
    sampled = lambda r: r.sampling.get("temperature", job.temperature) > 0
    # A sampled row's random stream is keyed by its position among the input's rows.
    keys = {r.id: r.fingerprint + (f"@{r.position}" if sampled(r) else "") for r in rows}
    out_path = Path(job.output) if job.output else None
    skip = Resume(out_path, rows, keys, settings, input_path).done if out_path and not job.overwrite else set()
    todo = [r for r in rows if r.id not in skip]
    return JobPlan(input_path, rows, todo, len(rows) - len(todo), pair, options, settings, keys, out_path,
                   demo_note=job.demo, per_row=any(r.sampling for r in rows))


class JobRun:
    """A planned job's rows through the engine: their prompts encoded, the rows that cannot run
    written as errors, the weights loaded, every turn decoded, the lines written through `out`."""

    def __init__(self, job: GenerationJob, plan: JobPlan, say, make_record: RecordMaker | None):
        self.job, self.plan, self.say, self.make_record = job, plan, say, make_record
        self.out = _NoWriter()
        self.errors = 0
        self.conversations: dict = {}
        self.runnable: list[InputRow] = []
        self.first: list[InputRow] = []  # the rows that ran (their first turn fit the engine)
        self.sample = None  # the demo shows one completion as text: (position, prompt, text)
        self.gen = self.stats = self.watchdog = None

    def encode_first_turns(self):
        """Turn 1 of every row (later turns of `turns` rows are encoded as earlier ones finish)."""
        tokenizer, thinking = self.plan.pair.tokenizer, self.job.enable_thinking
        for r in self.plan.todo:
            if r.kind == "turns":
                self.conversations[r.id] = [{"role": "user", "content": r.value[0]}]
            elif r.kind == "messages":
                self.conversations[r.id] = list(r.value)
            r.turn_ids.append(encode_prompt(r, tokenizer, self.conversations.get(r.id), thinking))

    def fail(self, r: InputRow, why: str):
        self.out.write({"id": r.id, "error": f"line {r.line}: {why}",
                        "fingerprint": {"input": self.plan.keys[r.id], **self.plan.settings}}, r)
        self.say(f"warning: id {r.id!r} (line {r.line}): {why}")
        self.errors += 1

    def limit(self, r: InputRow) -> int:
        return r.max_new_tokens or self.job.options.max_new_tokens

    def screen(self) -> int:
        """Rows that cannot run, found before anything loads (they do not size the cache), are
        written as errors; the others are `runnable`. Returns the cache's longest prompt."""
        job, tcfg, opts = self.job, self.plan.pair.target, self.job.options
        context = min(opts.max_prompt_len or tcfg.max_position_embeddings, tcfg.max_position_embeddings)
        for r in self.plan.todo:
            n = len(r.turn_ids[0])
            if n == 0 or n > context:
                self.fail(r, "empty prompt" if n == 0 else f"prompt of {n} tokens is longer than the context "
                                                            f"({context} tokens)")
            else:
                self.runnable.append(r)
        budgets = [prompt_budget(r, self.plan.pair.tokenizer, job.enable_thinking, opts.max_new_tokens)
                   for r in self.runnable]
        from dflash_jax.engine import bucket

        return opts.max_prompt_len or min(bucket(max(budgets, default=1)), tcfg.max_position_embeddings)

    def load_engine(self, max_prompt: int):
        """Read the weights onto the run's mesh and make the BatchEngine."""
        from dflash_jax.engine import GenerationStats

        job, pair, opts = self.job, self.plan.pair, self.job.options
        # The mesh comes first: every tensor is read straight into its shard on it, so no device ever
        # holds the whole model (one larger than a device loads on a mesh). The DFlash and baseline
        # engines share these arrays; their own shard_params is then a no-op.
        pair.load_weights(engine_mesh(opts.mesh), progress=not job.quiet)
        if pair.drafting and opts.block_size is not None and opts.block_size > pair.drafter.block_size:
            self.say(f"warning: --block-size {opts.block_size} is larger than the drafter's trained block "
                     f"({pair.drafter.block_size}); drafts past it are guesses it never learned")
        self.max_prompt = max_prompt
        self.watchdog = opts.watchdog()
        self.gen = self.engine(self.plan.options)
        self.stats = GenerationStats(self.gen.spec.block_size)
        self.prefix = [0, 0]  # prompt tokens served from the prefix cache, and all

    def engine(self, options: EngineOptions):
        """A BatchEngine of these options (the plan's, or their `plain` baseline) for the run's rows."""
        from dflash_jax.engine import BatchEngine, Sampling

        job = self.job
        return BatchEngine.of(self.plan.pair, options, max_new_tokens=options.max_new_tokens,
                                 max_prompt_len=self.max_prompt,
                                 sampling=Sampling(job.temperature, job.top_k, job.top_p, per_row=self.plan.per_row),
                                 watchdog=self.watchdog)

    def row_sampling(self, rs: list[InputRow]):
        """Each row's own sampling (over the job's), where some row sets its own; else None."""
        from dflash_jax.engine import Sampling

        job = self.job
        if not self.plan.per_row:
            return None
        return [Sampling(r.sampling.get("temperature", job.temperature), r.sampling.get("top_k", job.top_k),
                         r.sampling.get("top_p", job.top_p), per_row=True, constraint=self.automata.get(r.id),
                         logit_bias=r.sampling.get("logit_bias", ()))
                for r in rs]

    def compile_constraints(self, rows: list[InputRow]) -> None:
        """Each constrained row's automaton (`dflash_jax.constrain`, compiled once per constraint over the
        target's tokenizer), or the row written as an error where its constraint cannot run here."""
        from dflash_jax.constrain import ConstraintCache, vocabulary_of

        asked = [r for r in rows if "constraint" in r.sampling]
        self.refused: set = set()
        if not asked:
            return
        pair = self.plan.pair
        if pair.tokenizer is None:
            raise InputError("rows with a constraint (response_format, structured_outputs) need the target's "
                             "tokenizer, which constraints compile over")
        cache = ConstraintCache(vocabulary_of(pair.tokenizer, pair.target.vocab_size, pair.stop_tokens),
                                max_states=self.gen.spec.constraint_states)
        for r in asked:
            try:
                self.automata[r.id] = automaton = cache.get(r.sampling["constraint"])
                self.gen.regions.check(automaton)
            except InputError as e:
                self.fail(r, str(e))
                self.refused.add(r.id)

    def decode(self):
        """Every turn of every runnable row, its line written as it finishes."""
        from tqdm import tqdm

        from dflash_jax.compiling import CompileProgress

        job, gen, todo = self.job, self.gen, self.plan.todo
        self.automata: dict = {}
        # The engine's own limits (a page pool's size): still before any compile.
        self.compile_constraints(self.runnable)
        for r in self.runnable:
            if r.id in self.refused:
                continue
            why = gen.check_prompt(r.turn_ids[0], self.limit(r))
            if why:
                self.fail(r, why)
            else:
                self.first.append(r)
        drafts = f", {gen.spec.num_drafts} drafts verified" if job.options.draft_tokens else ""
        drafts = f", a tree of {gen.spec.tree_budget} nodes" if gen.spec.tree_budget else drafts
        with CompileProgress(f"compiling (block size {gen.spec.block_size}{drafts}, batch {gen.batch_size}, "
                             f"cache {gen.spec.cache_len})", quiet=job.quiet) as progress:
            gen.warmup([len(r.turn_ids[0]) for r in self.first], exact=True, progress=progress.step)
        # Shown in logs too (nohup, CI), where a slower refresh keeps the file small.
        bar = tqdm(total=len(todo), initial=len(todo) - len(self.first), desc="rows", unit="row",
                   disable=job.quiet, file=sys.stderr, mininterval=0.1 if sys.stderr.isatty() else 10.0)
        pending, turn = self.first, 0
        while pending:
            pending, turn = self.decode_turn(pending, turn, bar), turn + 1
        bar.close()

    def decode_turn(self, pending: list[InputRow], turn: int, bar) -> list[InputRow]:
        """One turn of the pending rows: the rows with a next turn (`turns` rows) are returned."""
        from dflash_jax.engine import timed

        job, gen, stats, tokenizer = self.job, self.gen, self.stats, self.plan.pair.tokenizer
        runnable, next_pending = [], []
        for r in pending:
            why = gen.check_prompt(r.turn_ids[turn], self.limit(r)) if turn else None
            if why:
                self.fail(r, why)
                bar.update(1)
            else:
                runnable.append(r)
        by_position = {r.position: r for r in runnable}
        results = gen.generate([r.turn_ids[turn] for r in runnable], indices=[r.position for r in runnable],
                               seed=job.seed, max_new_tokens=[self.limit(r) for r in runnable],
                               sampling=self.row_sampling(runnable))
        for res in timed(results, stats):
            r = by_position[res.index]
            record = result_record(res, tokenizer)
            if r.kind == "turns" and turn + 1 < len(r.value):
                # Multi-turn (z-lab benchmark format): the answer joins the conversation,
                # the next user turn runs in the next round.
                r.turn_records.append(record)
                self.conversations[r.id] += [{"role": "assistant", "content": record.get("text", "")},
                                             {"role": "user", "content": r.value[turn + 1]}]
                r.turn_ids.append(encode_prompt(r, tokenizer, self.conversations[r.id], job.enable_thinking))
                next_pending.append(r)
                continue
            if job.demo and r.kind == "prompt" and "text" in record and (
                    self.sample is None or r.position < self.sample[0]):
                self.sample = (r.position, r.value, record["text"])  # the first prompt's
            if r.turn_records:
                record["turns"] = r.turn_records + [dict(record)]
            line = self.make_record(r, record, self.conversations.get(r.id)) if self.make_record is not None \
                else {"id": r.id, **record}
            self.out.write({**line, "fingerprint": {"input": self.plan.keys[r.id], **self.plan.settings}}, r)
            shown = dict(tau=f"{stats.tau:.2f}") if gen.spec.block_size > 1 and stats.cycles else {}
            bar.set_postfix(tok_s=f"{stats.tokens_per_second:.1f}", **shown, refresh=False)
            bar.update(1)  # redraws at most every mininterval
        if gen.prefix_cache and runnable:
            self.prefix[0] += gen.ledger.cached_tokens
            self.prefix[1] += gen.ledger.prompt_tokens
        return next_pending

    def summary(self) -> dict:
        """The run's figures: tau over the cycles that drafted, the share of cycles each draft length
        ran and, where auto ran plain decoding, why (`speculation_summary`); with compare_baseline,
        plain decoding's and the speedup (`speedup_figures`)."""
        import jax

        job, gen, stats = self.job, self.gen, self.stats
        block_size = gen.spec.block_size
        summary = {"rows": len(self.plan.todo), "errors": self.errors, **stats.summary(),
                   "draft_tokens": gen.spec.num_drafts, "tree_budget": gen.spec.tree_budget}
        if block_size > 1:  # what ran: the draft lengths, their shares and (auto) why
            summary["speculation"] = speculation_summary(job.options.speculation if len(gen.candidates) > 1 else "fixed",
                                                         gen.policy.summary(), gen.auto_refusal, gen.spec.tree_budget)
        if gen.spec.draft_window:
            summary["draft_window"] = gen.spec.draft_window
        if gen.spec.selector:  # a DFlash2 drafter: its selector drafts; how its sampled rows accept
            summary["dflash2"] = True
            summary["acceptance"] = "rejection" if gen.spec.rejection else "match"
        if job.compare_baseline:
            self.say("compiling and timing plain decoding (block size 1) of the same prompts for the speedup ...")
            summary["baseline"] = baseline_summary(self.engine(self.plan.options.plain()), self.first, job.seed, self.limit,
                                                   self.row_sampling)
            summary.update(speedup_figures(summary, summary["baseline"], jax.default_backend()))
            if jax.default_backend() == "cpu" and block_size > 1 and summary["tau"] is not None:
                summary["note"] = cpu_note(gen.spec.verify_len, summary["tau"])
            if job.demo_prompts and summary.get("speedup") is not None and job.options.speculation == "fixed":
                summary["auto"] = auto_beside_fixed(summary["baseline"]["tokens_per_second"],
                                                    summary["tokens_per_second"], summary["tau"])
        if gen.prefix_cache:
            cached, prompt = self.prefix
            summary["prefix_cache"] = dict(prompt_tokens=prompt, cached_prompt_tokens=cached,
                                           hit_rate=round(cached / prompt, 4) if prompt else 0.0)
        summary["prompts"] = "the demo's prompts" if job.demo_prompts else str(self.plan.input_path)
        if job.demo and block_size > 1:
            summary["heldout"] = demo_figures()["heldout"]
        return summary


# --------------------------------------------------------------------------- the summary's figures

# Auto speculation's reason is given when plain decoding ran at least this share of the cycles.
PLAIN_MOSTLY = 0.5


def speculation_summary(mode: str, policy: dict, refusal: str | None = None, tree_budget: int = 0) -> dict:
    """What ran, from the policy's record (`Speculation.summary`): the mode, the share of the
    engine's cycles each draft length ran (`share`, K as a string; "0" plain decoding) and how
    many (`cycles`); auto's measurements (candidates, acceptance rates, ms per cycle, `reading`)
    and, where plain decoding ran at least PLAIN_MOSTLY of the cycles, why (`plain`:
    `plain_reason`); fixed where auto was refused, why (`fixed`)."""
    if mode != "auto" or refusal:
        out = {"mode": "fixed", "share": policy["share"], "cycles": policy["cycles"]}
        return {**out, "fixed": refusal} if refusal else out
    out = {"mode": "auto", **policy}
    why = plain_reason(policy["share"], policy.get("reading"), tree_budget)
    return {**out, "plain": why} if why else out


def draft_length_name(k: int | str, tree_budget: int = 0) -> str:
    """K=0 (plain), K=15, the tree (32 nodes): a draft length for a person."""
    k = int(k)
    if not k:
        return "K=0 (plain)"
    return f"the tree ({k} nodes)" if tree_budget else f"K={k}"


def plain_reason(share: dict, reading: dict | None, tree_budget: int = 0) -> str | None:
    """Why auto speculation ran plain decoding, in the figures its choice used (`Speculation.reading`:
    each draft length's cost in plain decoding's cycles, and the tokens per cycle the acceptance
    measured gives it; a draft length pays where those tokens exceed that cost). None unless plain
    decoding ran at least PLAIN_MOSTLY of the cycles and was timed."""
    plain = share.get("0", 0.0)
    if plain < PLAIN_MOSTLY or not reading or "0" not in reading["cycle_ms"]:
        return None
    ms, tokens, base = reading["cycle_ms"], reading["expected_tokens"], reading["cycle_ms"]["0"]
    article = lambda n: "an" if str(n).startswith("8") or n in (11, 18) else "a"
    costs = [f"{draft_length_name(k, tree_budget)}: {article(int(k) + 1)} {int(k) + 1}-token verify cost "
             f"{ms[k] / base:.1f} plain steps for {tokens[k]:.2f} tokens a cycle" for k in ms if k != "0"]
    best = int(reading["best"])
    verdict = ("no draft length paid for its verify, so plain decoding gave the most tokens/s" if not best else
               f"its last reading favours {draft_length_name(best, tree_budget)}, the earlier cycles' costs or "
               f"acceptance differed")
    return (f"auto ran plain decoding for {plain:.0%} of the engine's cycles: on this machine, at {reading['width']} slots, "
            f"{'; '.join(costs)} (tokens from the acceptance measured per draft position, {PRIOR_RATE} where none "
            f"was); {verdict}")


def speedup_figures(summary: dict, baseline: dict, backend: str) -> dict:
    """The speedup over plain decoding (`baseline`), where every cycle of the run drafted (or it
    is plain decoding itself), with where both were timed (`timed_on`: jax's backend); where auto
    speculation ran plain cycles, no speedup (None) and `no_speedup` says why, with both figures."""
    base, speed = baseline["tokens_per_second"], summary["tokens_per_second"]
    plain, drafted = summary.get("plain_cycles", 0), summary.get("cycles", 0)
    if summary["block_size"] > 1 and plain:
        share = summary.get("speculation", {}).get("share", {}).get("0")
        engine = f"{share:.0%} of the engine's cycles, " if share is not None else ""
        return {"speedup": None, "timed_on": backend,
                "no_speedup": f"no DFlash speedup to report: auto speculation ran plain decoding for {engine}{plain} "
                              f"of {plain + drafted} row cycles; this run {speed:.1f} tokens/s against plain "
                              f"decoding's {base:.1f}, both timed on this machine's {backend.upper()}"}
    return {"speedup": round(speed / base, 3) if base else None, "timed_on": backend}


def auto_beside_fixed(plain_speed: float, dflash_speed: float, tau: float) -> str:
    """For the demo, which runs fixed: what auto speculation, the default elsewhere, would do on
    this machine, from the two timings the demo has (it picks by timed costs, at every sync)."""
    verdict = ("would run plain decoding for most cycles on this machine" if plain_speed > dflash_speed else
               "would draft on this machine too")
    return (f"auto speculation (the default for your own runs) {verdict}: here plain decoding ran at "
            f"{plain_speed:.1f} tokens/s against DFlash's {dflash_speed:.1f} at tau {tau:.3f}, and auto picks by such "
            f"timed costs (`--speculation auto` runs it on the demo); on an accelerator a verify costs about one "
            f"decoding step (docs/benchmarks.md)")


def check_output_path(path: Path):
    """An output path that names a file, under directories (that may not exist yet): a one-line
    InputError otherwise."""
    if path.is_dir():
        raise InputError(f"--output {path} is a directory; give a file name")
    blocked = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise InputError(f"cannot write --output {path}: {blocked} is a file, not a directory")


def prepare_output(path: Path, overwrite: bool):
    """Check that the output can be written before anything loads (and, to start over, empty it):
    a one-line InputError naming the problem otherwise."""
    check_output_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # the output may name a new directory
        with open(path, "w" if overwrite else "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise InputError(f"cannot write --output {path}: {e.strerror or e}") from None


def trained_against(drafter_dir: Path) -> str:
    """' (trained against TARGET: ...)' for a drafter `python -m train.export` wrote, whose run
    recorded its target; '' otherwise."""
    try:
        run = Path(json.loads((drafter_dir / "dflash_training.json").read_text())["run"])
        target = json.loads((run / "train_config.json").read_text())["target"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return f" (this one was trained against {target}: add --target {target})"


def result_record(res, tokenizer) -> dict:
    record = {"output_ids": res.output_ids}
    if tokenizer is not None:
        record["text"] = tokenizer.decode(res.output_ids, skip_special_tokens=True)
    record.update(acceptance_lengths=res.acceptance_lengths, num_output_tokens=len(res.output_ids),
                  finish_reason=res.finish_reason)
    if res.plain_cycles:  # auto speculation's plain cycles: one token each, no acceptance length
        record["plain_cycles"] = res.plain_cycles
    return record


def demo_figures() -> dict:
    """Measured figures of the bundled pair and of the engine's cost report (demo/figures.json)."""
    return json.loads((DEMO_DIR / "figures.json").read_text())


def cpu_note(verify_len: int, tau: float) -> str:
    """Why a CPU shows no speedup, and what the cost report projects where a step is memory-bound:
    for the pair it names (a published one), not the demo's."""
    cost = demo_figures()["cost_report"]
    return (f"note: a CPU computes every verified token (a {verify_len}-token verify costs several decoding steps), "
            f"so DFlash gains little or loses here. Where a step is memory-bound (GPU/TPU), the cost report "
            f"projects {cost['projected_speedup']:.1f}x for another pair, {cost['shapes']}, at the paper's tau "
            f"{cost['tau']}; it is not a figure for this demo pair (tau {tau:.3f} here), too small to be memory-bound "
            f"anywhere (`{cost['command']}`)")


def baseline_summary(gen, rows: list[InputRow], seed: int, limit: Callable[[InputRow], int],
                     row_sampling: Callable[[list[InputRow]], Any] = lambda rows: None) -> dict:
    """Plain decoding of the same first-turn prompts (with the same limits and sampling), timed."""
    from dflash_jax.compiling import CompileProgress
    from dflash_jax.engine import GenerationStats, timed

    runnable = [r for r in rows if gen.check_prompt(r.turn_ids[0], limit(r)) is None]
    with CompileProgress("compiling plain decoding", quiet=True) as progress:
        gen.warmup([len(r.turn_ids[0]) for r in runnable], exact=True, progress=progress.step)
    stats = GenerationStats(1)
    results = gen.generate([r.turn_ids[0] for r in runnable], indices=[r.position for r in runnable], seed=seed,
                           max_new_tokens=[limit(r) for r in runnable], sampling=row_sampling(runnable))
    for _ in timed(results, stats):
        pass
    return stats.summary()

