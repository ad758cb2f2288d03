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
import numbers
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from dflash_jax.errors import DFlashError

DEMO_DIR = Path(__file__).resolve().parent / "demo"
DTYPES = ("bfloat16", "float32")


class InputError(DFlashError):
    pass


# --------------------------------------------------------------------------- the job


@dataclass(frozen=True)
class GenerationJob:
    """One batch generation run: what `python -m infer` does with these flags (the field
    `max_new_tokens` is `--max-new-tokens`, and so on; the same defaults). With no target it runs
    the bundled demo pair on its prompts (and, with no input, compares with the baseline).
    Checked when made: a field out of range is an InputError naming its flag."""

    target: str | Path | None = None  # HF or converted directory (None: the demo pair)
    drafter: str | Path | None = None  # DFlash drafter; None: plain decoding (the demo's, for the demo)
    input: str | Path | None = None  # prompts JSONL (None: the demo's prompts; required with a target)
    output: str | Path | None = None  # results JSONL, appended, resumed; None: stdout
    max_new_tokens: int | None = None  # per row, and the most a row may ask for (None: 256; 128 for the demo)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    seed: int = 0  # seed of the sampling keys (per row and position)
    block_size: int | None = None  # None: the drafter's; 1 = plain autoregressive decoding
    draft_tokens: int | None = None  # drafts verified per cycle, 1..B-1 (None: B-1)
    batch_size: int = 8  # rows decoded together
    dtype: str | None = None  # "bfloat16" | "float32" (None: the checkpoint's)
    ignore_eos: bool = False  # do not stop at the stop tokens
    compare_baseline: bool = False  # also time plain decoding and report the speedup
    enable_thinking: bool = False  # enable_thinking=True for the chat template (Qwen3)
    max_prompt_len: int | None = None  # sizes the KV cache (None: the longest prompt, rounded up)
    kv_pages: int | None = None  # a shared pool of this many K/V pages (None: per-row caches)
    page_size: int = 128  # K/V positions per page
    sync_every: int = 8  # decoding cycles per host sync
    narrow_tail: bool = False  # run the batch's tail on narrower loops
    mesh: str | None = None  # "data=D,model=M" (None: every device on `data`; one device: no mesh)
    stall_timeout: float = 10.0  # minutes without device progress before a stall error; 0 = never
    quiet: bool = False  # no progress bar or progress messages

    def __post_init__(self):
        """Checks that need no model, so a bad field fails before anything loads."""
        if self.target is None and self.drafter is not None:
            raise InputError("--drafter needs --target, the model it drafts for" + trained_against(Path(self.drafter)))
        if self.target is not None and not self.input:
            raise InputError("--input is required when --target is given")
        for flag, value in (("--max-new-tokens", self.max_new_tokens), ("--batch-size", self.batch_size),
                            ("--sync-every", self.sync_every), ("--block-size", self.block_size),
                            ("--draft-tokens", self.draft_tokens), ("--max-prompt-len", self.max_prompt_len),
                            ("--kv-pages", self.kv_pages), ("--page-size", self.page_size)):
            if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool)):
                raise InputError(f"{flag} must be an integer, got {value!r}")
            if value is not None and value < 1:
                raise InputError(f"{flag} must be >= 1, got {value}")
        if not self.stall_timeout >= 0:
            raise InputError(f"--stall-timeout must be >= 0 minutes, got {self.stall_timeout}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InputError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.draft_tokens is not None and (self.drafter_dir is None or self.block_size == 1):
            raise InputError("--draft-tokens needs a drafter (it sets how many of the drafter's tokens are verified)")

    @property
    def demo(self) -> bool:
        """No target: the bundled demo pair."""
        return self.target is None

    @property
    def target_dir(self) -> Path:
        return Path(self.target) if self.target else DEMO_DIR / "target"

    @property
    def drafter_dir(self) -> Path | None:
        if self.drafter:
            return Path(self.drafter)
        return DEMO_DIR / "drafter" if self.demo else None

    @property
    def input_path(self) -> Path:
        return Path(self.input) if self.input else DEMO_DIR / "prompts.jsonl"

    def resolved(self) -> GenerationJob:
        """The job with its defaults that depend on others filled in: max_new_tokens (256; 128 for
        the demo pair), and the demo on its own prompts compares with the baseline."""
        max_new = self.max_new_tokens if self.max_new_tokens is not None else (128 if self.demo else 256)
        baseline = self.compare_baseline or (self.demo and self.input is None and self.block_size != 1)
        return replace(self, max_new_tokens=max_new, compare_baseline=baseline)


@dataclass(frozen=True)
class GenerationResult:
    """What `run_job` returns. summary: rows, errors, tokens/s, tau, the acceptance histogram,
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
    turn_ids: list[list[int]] = field(default_factory=list)  # prompt ids, one per turn so far
    turn_records: list[dict] = field(default_factory=list)  # finished turns of a `turns` row


PROMPT_KEYS = ("input_ids", "prompt", "messages", "turns")
ROW_KEYS = PROMPT_KEYS + ("id", "max_new_tokens")


def read_rows(path: Path, warn=lambda message: None) -> list[InputRow]:
    """The rows of an input JSONL file (named in errors as given). Keys other than ROW_KEYS are
    ignored, each named once through `warn`; a line with no prompt key but an unknown one names
    it (a misspelt `prompt`)."""
    from dflash_jax.data import iter_jsonl_objects

    rows, seen, unknown = [], set(), {}
    for n, obj in iter_jsonl_objects(path, InputError, "input file"):
        where = f"{path} line {n}"
        kinds = [k for k in PROMPT_KEYS if k in obj]
        extra = [k for k in obj if k not in ROW_KEYS]
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
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise InputError(f"{where}: max_new_tokens must be a positive integer")
        row_id = obj.get("id", n)
        if not isinstance(row_id, (str, int)) or isinstance(row_id, bool):
            raise InputError(f"{where}: id must be a string or an integer")
        if row_id in seen:
            raise InputError(f"{where}: duplicate id {row_id!r}")
        seen.add(row_id)
        rows.append(InputRow(row_id, n, kind, value, position=len(rows), max_new_tokens=limit))
    for k, n in unknown.items():
        warn(f"warning: {path} line {n}: unknown key {k!r} ignored (keys: {', '.join(ROW_KEYS)})")
    return rows


def load_tokenizer(target_dir: Path):
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((target_dir / n).is_file() for n in names):
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Without torch (the default install) transformers advises at import that its models are
    # unavailable: only its tokenizers are used here.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(target_dir))
    except Exception as e:  # transformers raises many types for broken tokenizer files
        raise InputError(f"cannot load the tokenizer in {target_dir}: {str(e).splitlines()[0]}") from None


def encode_prompt(row: InputRow, tokenizer, messages: list[dict] | None, thinking: bool) -> list[int]:
    """Token ids of a row's (current) prompt."""
    if row.kind == "input_ids":
        return list(row.value)
    if tokenizer is None:
        raise InputError(f"line {row.line}: '{row.kind}' needs a tokenizer, and the target has none")
    if row.kind == "prompt":
        return tokenizer(row.value, add_special_tokens=True)["input_ids"]
    if getattr(tokenizer, "chat_template", None) is None:
        raise InputError(f"line {row.line}: '{row.kind}' needs a chat template, and the tokenizer has none")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        enable_thinking=thinking)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


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


def stop_token_ids(target_dir: Path, tokenizer) -> list[int]:
    ids: list = []
    for name in ("generation_config.json", "config.json"):
        path = target_dir / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                ids = eos if isinstance(eos, list) else [eos]
                break
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return [int(i) for i in ids]


# --------------------------------------------------------------------------- output


def completed_ids(path: Path) -> set:
    """Ids already in an output file. A torn last line (an interrupted write) is cut off."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    done = set()
    for line in data[:keep].splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "id" in obj and "error" not in obj:
            done.add(obj["id"])
    return done


class JsonlWriter:
    """Appends records as JSON lines, each flushed as it is written: to `path` (its directory
    created), or to stdout without one. `format` makes a record's text (the CLI's writer shows
    rows readably on a terminal)."""

    def __init__(self, path: str | Path | None):
        self.owned = bool(path)
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)  # the output may name a new directory
            self.file = open(path, "a", encoding="utf-8")
        else:
            self.file = sys.stdout

    def format(self, record: dict, row: InputRow | None) -> str:
        return json.dumps(record, ensure_ascii=False) + "\n"

    def write(self, record: dict, row: InputRow | None = None):
        self.file.write(self.format(record, row))
        self.file.flush()

    def close(self):
        if self.owned:
            self.file.close()


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
    """Run a generation job: rows are appended to `job.output` as they finish (ids already there
    are skipped) and the summary is returned, not printed. Bad input raises InputError (or another
    DFlashError) before a weight is read.

    make_record(row, record, conversation) -> dict, if given, shapes each output line (its
    conversation: the chat messages a `messages`/`turns` row's last prompt was made of, else None;
    `train.generate_data` writes conversations with it). writer(path) opens what the lines go
    through (an object with write(record, row) and close(); default: JsonlWriter), on process 0
    only, once the models are loaded."""
    from tqdm import tqdm

    import jax

    from dflash_jax.checkpoint import load_drafter, load_target, read_model_config
    from dflash_jax.drafter import check_pair
    from dflash_jax.sharding import make_mesh
    from dflash_jax.engine import Generator, GenerationStats, Sampling, bucket, timed
    from dflash_jax.engine.watchdog import Watchdog

    job = job.resolved()
    demo, target_dir, drafter_dir, input_path = job.demo, job.target_dir, job.drafter_dir, job.input_path
    sampling = Sampling(job.temperature, job.top_k, job.top_p)
    say = (lambda *a: None) if job.quiet else (lambda *a: print(*a, file=sys.stderr))

    rows = read_rows(input_path, warn=say)
    if not rows:
        raise InputError(f"{input_path} holds no rows (one JSON object per line, each with one of "
                         f"{', '.join(PROMPT_KEYS)})")
    # Checked from the configs alone, before a weight is read or a program compiled.
    tcfg = read_model_config(target_dir, "target", dtype=job.dtype)
    for r in rows:
        bad = [t for t in (r.value if r.kind == "input_ids" else ()) if not 0 <= t < tcfg.vocab_size]
        if bad:
            raise InputError(f"{input_path} line {r.line}: token id {bad[0]} is outside the target's vocabulary "
                             f"(0..{tcfg.vocab_size - 1})")
    if drafter_dir is not None and job.block_size != 1:
        for warning in check_pair(tcfg, read_model_config(drafter_dir, "drafter", dtype=job.dtype)):
            say(f"warning: {warning}")
    over = next((r for r in rows if r.max_new_tokens is not None and r.max_new_tokens > job.max_new_tokens), None)
    if over is not None:
        raise InputError(f"{input_path} line {over.line}: max_new_tokens {over.max_new_tokens} is more than "
                         f"--max-new-tokens {job.max_new_tokens}, which sizes the cache")
    out_path = Path(job.output) if job.output else None
    skip = completed_ids(out_path) if out_path else set()
    todo = [r for r in rows if r.id not in skip]
    skipped = len(rows) - len(todo)
    if demo:
        say(f"no --target given: running the bundled demo pair ({DEMO_DIR})")
    if skip and not todo:
        # Nothing left: say so even when quiet (a resumed job's log should show why it did nothing),
        # and load no model.
        if jax.process_index() == 0:
            print(f"{out_path}: all {len(rows)} rows already done, nothing to generate", file=sys.stderr)
        return GenerationResult(None, skipped=skipped)
    if skip:
        say(f"{out_path}: {skipped} of {len(rows)} rows already done, skipping them")

    # Every row's first prompt is encoded before a weight is read: a row that cannot be fails fast.
    tokenizer = load_tokenizer(target_dir)
    stops = [] if job.ignore_eos else stop_token_ids(target_dir, tokenizer)

    # Turn 1 of every row (later turns of `turns` rows are encoded as earlier ones finish).
    conversations = {}
    for r in todo:
        if r.kind == "turns":
            conversations[r.id] = [{"role": "user", "content": r.value[0]}]
        elif r.kind == "messages":
            conversations[r.id] = list(r.value)
        r.turn_ids.append(encode_prompt(r, tokenizer, conversations.get(r.id), job.enable_thinking))
    budgets = [prompt_budget(r, tokenizer, job.enable_thinking, job.max_new_tokens) for r in todo]
    max_prompt = job.max_prompt_len or min(bucket(max(budgets, default=1)), tcfg.max_position_embeddings)

    # The mesh comes first: every tensor is read straight into its shard on it, so no device ever
    # holds the whole model (one larger than a device loads on a mesh). The DFlash and baseline
    # engines share these arrays; their own shard_params is then a no-op.
    mesh = make_mesh(job.mesh) if (job.mesh or jax.device_count() > 1) else None
    tcfg, tparams = load_target(target_dir, dtype=job.dtype, progress=not job.quiet, mesh=mesh)
    dcfg = dparams = None
    if drafter_dir is not None and job.block_size != 1:
        dcfg, dparams = load_drafter(drafter_dir, dtype=job.dtype, progress=not job.quiet, mesh=mesh)
        if job.block_size is not None and job.block_size > dcfg.block_size:
            say(f"warning: --block-size {job.block_size} is larger than the drafter's trained block "
                f"({dcfg.block_size}); drafts past it are guesses it never learned")

    watchdog = Watchdog(job.stall_timeout * 60) if job.stall_timeout > 0 else None

    def engine(block_size):
        drafts = job.draft_tokens if block_size != 1 else None
        return Generator(tcfg, tparams, dcfg, dparams, block_size=block_size, batch_size=job.batch_size,
                         max_new_tokens=job.max_new_tokens, max_prompt_len=max_prompt, sampling=sampling,
                         stop_token_ids=stops, sync_every=job.sync_every, mesh=mesh, draft_tokens=drafts,
                         watchdog=watchdog, kv_pages=job.kv_pages, page_size=job.page_size,
                         narrow_tail=job.narrow_tail)

    def limit(r: InputRow) -> int:
        return r.max_new_tokens or job.max_new_tokens

    gen = engine(job.block_size)
    block_size = gen.spec.block_size
    stats = GenerationStats(block_size)
    out = writer(out_path) if jax.process_index() == 0 else _NoWriter()
    errors = 0
    sample = None  # the demo shows one completion as text
    try:
        drafts = f", {gen.spec.num_drafts} drafts verified" if job.draft_tokens else ""
        say(f"compiling (block size {block_size}{drafts}, batch {job.batch_size}, cache {gen.spec.cache_len}) ...")
        t0 = time.perf_counter()
        gen.warmup([len(r.turn_ids[0]) for r in todo], exact=True)
        say(f"compiled in {time.perf_counter() - t0:.1f}s")
        # Shown in logs too (nohup, CI), where a slower refresh keeps the file small.
        bar = tqdm(total=len(todo), desc="rows", unit="row", disable=job.quiet, file=sys.stderr,
                   mininterval=0.1 if sys.stderr.isatty() else 10.0)
        pending = todo
        turn = 0
        while pending:
            runnable, next_pending = [], []
            for r in pending:
                why = gen.check_prompt(r.turn_ids[turn], limit(r))
                if why:
                    out.write({"id": r.id, "error": f"line {r.line}: {why}"}, r)
                    say(f"warning: id {r.id!r} (line {r.line}): {why}")
                    errors += 1
                    bar.update(1)
                else:
                    runnable.append(r)
            by_position = {r.position: r for r in runnable}
            results = gen.generate([r.turn_ids[turn] for r in runnable], indices=[r.position for r in runnable],
                                   seed=job.seed, max_new_tokens=[limit(r) for r in runnable])
            for res in timed(results, stats):
                r = by_position[res.index]
                record = result_record(res, tokenizer)
                if r.kind == "turns" and turn + 1 < len(r.value):
                    # Multi-turn (z-lab benchmark format): the answer joins the conversation,
                    # the next user turn runs in the next round.
                    r.turn_records.append(record)
                    conversations[r.id] += [{"role": "assistant", "content": record.get("text", "")},
                                            {"role": "user", "content": r.value[turn + 1]}]
                    r.turn_ids.append(encode_prompt(r, tokenizer, conversations[r.id], job.enable_thinking))
                    next_pending.append(r)
                    continue
                if demo and r.kind == "prompt" and "text" in record and (sample is None or r.position < sample[0]):
                    sample = (r.position, r.value, record["text"])  # the first prompt's
                if r.turn_records:
                    record["turns"] = r.turn_records + [dict(record)]
                if make_record is not None:
                    out.write(make_record(r, record, conversations.get(r.id)), r)
                else:
                    out.write({"id": r.id, **record}, r)
                shown = dict(tau=f"{stats.tau:.2f}") if block_size > 1 else {}
                bar.set_postfix(tok_s=f"{stats.tokens_per_second:.1f}", **shown, refresh=False)
                bar.update(1)  # redraws at most every mininterval
            pending, turn = next_pending, turn + 1
        bar.close()
    finally:
        out.close()

    summary = {"rows": len(todo), "errors": errors, **stats.summary(),
               "draft_tokens": gen.spec.num_drafts}
    if job.compare_baseline:
        say("compiling and timing plain decoding (block size 1) of the same prompts for the speedup ...")
        summary["baseline"] = baseline_summary(engine(1), todo, job.seed, limit)
        base = summary["baseline"]["tokens_per_second"]
        summary["speedup"] = round(stats.tokens_per_second / base, 3) if base else None
        if jax.default_backend() == "cpu" and block_size > 1:
            summary["note"] = cpu_note(gen.spec.verify_len)
    summary["prompts"] = "the demo's prompts" if demo and job.input is None else str(input_path)
    if demo and block_size > 1:
        summary["heldout"] = demo_figures()["heldout"]
    return GenerationResult(summary, skipped=skipped, sample=sample[1:] if sample is not None else None)


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
    return record


def demo_figures() -> dict:
    """Measured figures of the bundled pair and of the engine's cost report (demo/figures.json)."""
    return json.loads((DEMO_DIR / "figures.json").read_text())


def cpu_note(verify_len: int) -> str:
    """Why a CPU shows no speedup, and what the cost report projects where a step is memory-bound."""
    cost = demo_figures()["cost_report"]
    return (f"note: a CPU computes every verified token (a {verify_len}-token verify costs several decoding steps), "
            f"so DFlash gains little or nothing here; where a step is memory-bound (GPU/TPU) the cost report "
            f"projects {cost['projected_speedup']:.1f}x for {cost['shapes']} at the paper's tau {cost['tau']} "
            f"(`{cost['command']}`)")


def baseline_summary(gen, rows: list[InputRow], seed: int, limit: Callable[[InputRow], int]) -> dict:
    """Plain decoding of the same first-turn prompts (with the same limits), timed."""
    from dflash_jax.engine import GenerationStats, timed

    runnable = [r for r in rows if gen.check_prompt(r.turn_ids[0], limit(r)) is None]
    gen.warmup([len(r.turn_ids[0]) for r in runnable], exact=True)
    stats = GenerationStats(1)
    results = gen.generate([r.turn_ids[0] for r in runnable], indices=list(range(len(runnable))), seed=seed,
                           max_new_tokens=[limit(r) for r in runnable])
    for _ in timed(results, stats):
        pass
    return stats.summary()

