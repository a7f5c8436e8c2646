"""``zoomkv eval``: methods × budgets × tasks in one run, with accuracy, bytes per tier and decode speed.

    zoomkv eval --model smollm2-135m --methods snapkv,oracle_topk --budgets 128,512 \\
        --tasks niah_single_1,vt --length 4096 --samples 8 --out runs/eval
    zoomkv eval --model smollm2-135m --methods quest --budgets 256 --grid-lengths 1024,2048,4096 --out runs/grid
    zoomkv eval --model smollm2-135m --adapter checkpoints/sekv-smollm2 --methods quest --budgets 256 --out runs/adapter
    zoomkv eval --model smollm2-135m --methods snapkv --budgets 128 --tasks niah_single_2 --protocol query-aware --out runs/qa
    zoomkv eval --list-tasks
    accelerate launch --num_processes 2 -m zoomkv eval --model smollm2-135m --methods quest --budgets 256 --out runs/q
    torchrun --nproc_per_node 2 -m zoomkv eval --model smollm2-135m --methods quest --budgets 256 --out runs/q

Several processes (a launcher above; GPUs or machines) share the prompts, each on its own device; the main
process merges their rows into one rows.jsonl and summary.md (which says how many processes ran). A killed
run resumes with any number of processes.

Your own data, --data FILE.jsonl: one JSON object per line, the plain format at its simplest

    {"prompt": "What is the pass key?", "answers": ["71934"], "context": "<the long document>"}

with optional "answer_prefix", "metric" (default qa_f1; string_match_all, string_match_part, exact_number,
choice, ...), "task", "max_new_tokens", "all_classes", "chat". LongBench, LongBench-v2, InfiniteBench, RULER
export and GSM8K records are told by their fields (or --data-format); zoomkv/eval/README.md has each format.

Haystacks: the tasks marked [uses --haystack] in --list-tasks hide their needles in --haystack prose (kjv, the
shipped King James Bible, by default); the others in RULER's noise sentences. Each row records its haystack.
"""

from __future__ import annotations

import argparse
import logging
import shlex
from typing import Any

from zoomkv.cli_args import add_run_arguments, int_option, parse_run_method_args
from zoomkv.data.files import FORMATS as DATA_FORMATS
from zoomkv.errors import ZoomKVError

log = logging.getLogger(__name__)

DEFAULT_LENGTH = "4096"


def _split(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def _ints(text: str | None, flag: str) -> list[int]:
    try:
        return [int(t) for t in _split(text)]
    except ValueError:
        raise ZoomKVError(f"{flag} expects comma-separated whole numbers, got {text!r}") from None


def _floats(text: str | None, flag: str) -> list[float]:
    try:
        return [float(t) for t in _split(text)]
    except ValueError:
        raise ZoomKVError(f"{flag} expects comma-separated numbers, got {text!r}") from None


def config_from_args(args: argparse.Namespace) -> Any:
    from zoomkv.eval.harness import EvalConfig

    if not args.out:
        raise ZoomKVError("give the output folder with --out DIR")
    from zoomkv.eval.rows import check_output_folder

    check_output_folder(args.out)  # a file in the way or a read-only place: refused before the model loads
    lengths = _ints(args.length or DEFAULT_LENGTH, "--length")
    if not lengths:
        raise ZoomKVError("--length needs at least one token count")
    tasks = _split(args.tasks)
    if args.tasks is None and not args.data and not args.grid_lengths:
        tasks = ["niah_single_1"]
    return EvalConfig(
        model=args.model, out=args.out, methods=_split(args.methods), budgets=_split(args.budgets), tasks=tasks,
        lengths=lengths, lengths_defaulted=args.length is None, samples=args.samples, data=args.data or [], data_format=args.data_format,
        haystack=args.haystack, grid_lengths=_ints(args.grid_lengths, "--grid-lengths"),
        grid_depths=_floats(args.grid_depths, "--grid-depths"), method_args=parse_run_method_args(args.method_args),
        adapters=[a for group in args.adapter or [] for a in _split(group)], tail_summary=args.tail_summary,
        kv_quant=args.kv_quant, kv_quant_tiers=args.kv_quant_tiers,
        batch_size=args.batch_size, seed=args.seed, chat={"auto": None, "on": True, "off": False}[args.chat],
        max_new_tokens=args.max_new_tokens, dtype=args.dtype, device=args.device, overwrite=args.overwrite,
        report_only=args.report_only,
        plots=not args.no_plots, progress=not args.quiet, threads=args.threads,
        command=command_line(args), protocol=args.protocol, prefill_chunk=args.prefill_chunk,
        diagnose=args.diagnose,
    )


# What a report's command keeps: the settings that pick which stored rows it reads (the folder's identity).
REPORT_KEYS = ("model", "report_only", "out", "protocol", "haystack", "chat", "dtype", "seed", "max_new_tokens",
               "prefill_chunk", "diagnose")


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run, every setting spelled out (recorded in the summary). A report
    reads the rows already stored: only what selects them (model, protocol, folder) applies, and the runs'
    own settings (methods, samples, ...) would be misread as this report's."""
    keep = REPORT_KEYS if args.report_only else None
    parts = ["zoomkv", "eval"]
    for key, value in vars(args).items():
        if key in ("func", "command", "list_tasks", "overwrite", "quiet", "verbose") or value in (None, False, [], ""):
            continue
        if keep is not None and key not in keep:
            continue
        if (key == "grid_depths" and not args.grid_lengths) or (key == "data_format" and not args.data):
            continue  # settings of features this run does not use
        flag = "--" + key.replace("_", "-")
        for v in value if isinstance(value, list) else [value]:
            parts += [flag] if v is True else [flag, str(v)]
    return " ".join(shlex.quote(p) for p in parts)


def list_tasks() -> None:
    from zoomkv.eval.tasks import SYNTHETIC_TASKS

    for task in SYNTHETIC_TASKS.values():
        print(f"{task.name:16s} {task.description}{'  [uses --haystack]' if task.essay else ''}")
    print(f"{'niah_grid':16s} single needle over --grid-lengths × --grid-depths (a heatmap per method)")
    print("--data [NAME=]SOURCE       a .jsonl/.json/.parquet/.csv file, a saved dataset folder or a Hub id of LongBench, "
          "LongBench-v2, InfiniteBench, RULER-export, plain {prompt, answers, ...} or GSM8K {question, answer} records")


def run(args: argparse.Namespace) -> int:
    if args.list_tasks:
        list_tasks()
        return 0
    from zoomkv.eval.harness import run_eval

    cfg = config_from_args(args)
    rows = run_eval(cfg)
    from zoomkv.eval.shards import is_main_process

    if not is_main_process():  # the main process of a sharded run prints the merged summary
        return 0
    from pathlib import Path

    out = Path(cfg.out)
    print((out / "summary.md").read_text(encoding="utf-8"))
    log.info("%d rows; wrote %s in %s", len(rows), ", ".join(sorted(p.name for p in out.iterdir() if p.is_file())), out)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="registered name, hub id or local folder")
    add_run_arguments(parser, several=True, methods="full", budgets="")
    parser.add_argument("--tasks", default=None, help="comma-separated synthetic tasks (see --list-tasks)")
    parser.add_argument("--length", default=None,
                        help=f"target prompt length(s) in tokens, comma-separated (default {DEFAULT_LENGTH}); --data "
                             "records longer than that are cut in the middle to fit, and a warning says how many")
    parser.add_argument("--samples", type=int_option(1, 1_000_000), default=4, help="samples per task and length (and grid cell)")
    parser.add_argument("--data", action="append", metavar="[NAME=]SOURCE",
                        help="task records from a .jsonl/.json/.parquet/.csv file, a saved dataset folder or a Hub "
                             "dataset id (LongBench, LongBench-v2, InfiniteBench, RULER export, plain or GSM8K "
                             "format; repeatable)")
    parser.add_argument("--data-format", default="auto", choices=list(DATA_FORMATS),
                        help="the records' format (auto: told by the first record's fields)")
    parser.add_argument("--haystack", "--haystack-dir", dest="haystack", default="kjv", metavar="SOURCE",
                        help="the prose of RULER's essay tasks: kjv (shipped, the default), python-docs, noise, a "
                             "folder of .txt/.md files, a JSONL/Parquet/CSV file or a dataset (field 'text')")
    parser.add_argument("--grid-lengths", help="NIAH grid context lengths, comma-separated")
    parser.add_argument("--grid-depths", default="0,0.25,0.5,0.75,1", help="NIAH grid needle depths in [0, 1]")
    parser.add_argument("--batch-size", type=int_option(1), default=1, help="prompts prefilled and decoded together")
    parser.add_argument("--seed", type=int_option(0, 2**32 - 1), default=0, help="seed of the task generators")
    parser.add_argument("--chat", choices=["auto", "on", "off"], default="off",
                        help="wrap prompts in the model's chat template (auto: when it has one); default off, "
                             "as RULER prompts with an answer prefix")
    parser.add_argument("--protocol", choices=["query-agnostic", "query-aware"], default="query-agnostic",
                        help="query-agnostic (default): compress the context before the question arrives, then ask "
                             "it over the compressed cache; query-aware: compress the whole prompt, question included")
    parser.add_argument("--diagnose", action="store_true",
                        help="score every step's selection against full attention: the share of its mass kept and "
                             "the overlap with the exact top-B rows, per layer, KV head and answer token "
                             "(summary.md table, diagnostics_*.png; slower)")
    parser.add_argument("--max-new-tokens", type=int, help="override every task's generation length")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int_option(1, 4096), help="CPU threads for torch (fewer can be faster on a busy machine)")
    parser.add_argument("--out", help="output folder (rows.jsonl, rows.csv, rows.json, summary.md, plots): new, "
                                      "empty, or an earlier run's to resume it")
    parser.add_argument("--overwrite", action="store_true",
                        help="discard the rows and report files an earlier run wrote in --out (run.json lists them) "
                             "instead of resuming; nothing else there")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: write the summary and plots of the rows already in --out (several runs' "
                             "rows.jsonl put together in one folder, say)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar, warnings only")
    parser.add_argument("--list-tasks", action="store_true", help="list the tasks and exit")
