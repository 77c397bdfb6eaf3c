"""Command line: stageplan profile | plan | run | link | compare
| tune | show | calibrate. Parsing and printing only."""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from stageplan._io import save_or_keep
from stageplan._version import __version__
from stageplan.errors import PlanNote, RunError, StageplanError


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" only where X says something: not to a help text that says its default in words,
    and not None (an option that is off unless given) or False (a flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # one line, exit 2, no usage dump
        # main prints "stageplan: error: ", so a subcommand's error names the subcommand alone
        command = self.prog.partition(" ")[2]
        raise StageplanError(f"{command + ': ' if command else ''}{message}; see '{self.prog} --help'")


def parse_set(items: Sequence[str] | None) -> dict[str, Any]:
    """--set key=value, values parsed as int, float or bool where they look like one."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()):
            raise StageplanError(f"--set expects key=value with a Python identifier as key, got {item!r}; "
                                 f"e.g. --set n_layer=12")
        out[key.strip()] = _parse_value(raw.strip())
    return out


def _parse_value(raw: str) -> Any:
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="built-in name (gpt, convnet, hf-gpt2, hf-llama, hf with --set preset=NAME "
                   "or --set config=PATH) or package.module:factory")
    p.add_argument("--set", dest="factory_options", action="append", metavar="KEY=VALUE", default=None,
                   help="an option for the model's factory, e.g. --set n_layer=12 (repeatable)")


def _add_pin_arg(p: argparse.ArgumentParser) -> None:
    # the default is set apart (first, so the flag keeps SUPPRESS) and the help does not read "(default:
    # True)" beside a flag that turns pinning off
    p.set_defaults(pin_cpus=True)
    p.add_argument("--no-pin", dest="pin_cpus", action="store_false", default=argparse.SUPPRESS,
                   help="let the OS place the ranks instead of each CPU rank on its own block of CPUs (two "
                        "jobs on one machine would share those blocks)")


def _add_loop_args(p: argparse.ArgumentParser, *, steps: int, warmup: int = 2) -> None:
    """What compare and tune share: the model, the pipeline, and how each run is measured."""
    _add_model_args(p)
    p.add_argument("--stages", type=int, required=True, help="pipeline ranks (p)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="m (default: 4 microbatches of a quarter of the batch)")
    p.add_argument("--schedule", default="1F1B", help="schedule of every run")
    p.add_argument("--steps", type=int, default=steps, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=warmup, help="steps before measuring")
    p.add_argument("--runs", type=int, default=1, metavar="K", help="run the plans measured side by side "
                   "(compare: every method's; tune: the final and the uniform) K times each, in turns (A B A "
                   "B ...), and take medians: a shared machine drifts over minutes, and in turns it drifts "
                   "on every plan alike; tune also runs each round's plan K times and calibrates from its "
                   "median run")
    p.add_argument("--profile", default=None, metavar="PROFILE.json",
                   help="start from this profile instead of profiling")
    p.add_argument("--processes", type=int, default=1, help="profile in N fresh processes, per layer the "
                   "median (as stageplan profile --processes)")
    p.add_argument("--min-time", type=float, default=0.0, metavar="SECONDS",
                   help="spread the profile's timed rounds over SECONDS (as stageplan profile --min-time)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds before a run's ranks (or, with --processes, a profiling process) are ended")
    _add_pin_arg(p)
    p.add_argument("--objective", default="bottleneck", help="what the optimal plans minimise: bottleneck or "
                   "step (as stageplan plan --objective)")
    p.add_argument("--order", choices=["stage", "layer"], default=None,
                   help="how the profile times its layers (as stageplan profile --order; default: stage)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="stageplan",
                     description="Profile, plan, run and check pipeline-parallel stage splits.")
    parser.add_argument("--version", action="version", version=f"stageplan {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_profile_command(sub)
    _add_plan_command(sub)
    _add_run_command(sub)
    _add_link_command(sub)
    _add_calibrate_command(sub)
    _add_compare_command(sub)
    _add_tune_command(sub)
    _add_show_command(sub)
    _add_layout_command(sub)
    return parser


def _add_layout_command(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "layout", help="choose pipeline x data x tensor degrees, microbatching, schedule, recompute and "
                       "sharding for N devices -> LAYOUT.json",
        description="Search the layout grid with the exact split inside each candidate. Default grid: "
                    "tensor parallel 1, 2, 4, 8 (up to a node; HF decoders only), every pipeline degree "
                    "dividing N / t up to the layers, microbatch sizes 1, 2, 4, 8, GPipe, 1F1B and "
                    "Interleaved1F1B with every valid v, recompute none or full, sharding ddp, zero1 or "
                    "fsdp.")
    p.add_argument("source", nargs="+", metavar="PROFILE.json | MODEL",
                   help="profiles (one per microbatch size), or a model spec such as hf with --set "
                        "preset=NAME")
    p.add_argument("--set", dest="factory_options", action="append", metavar="KEY=VALUE", default=None,
                   help="an option for the model's factory, e.g. --set preset=llama3-70b (repeatable)")
    p.add_argument("--device", default=None, help="for a model spec: estimate:GPU (e.g. estimate:h100-sxm), "
                   "cpu or cuda")
    p.add_argument("--devices", type=int, required=True, help="N, the devices to lay the model out on")
    p.add_argument("--devices-per-node", type=int, default=8, help="devices in a node (default 8)")
    p.add_argument("--memory-limit", default=None, help="per-device memory, e.g. 80GiB")
    p.add_argument("--global-batch-size", type=int, required=True, help="sequences (samples) per step")
    p.add_argument("--precision", default="bf16-mixed", help="fp32, bf16, bf16-mixed or fp16-mixed "
                   "(default bf16-mixed)")
    p.add_argument("--grad-dtype", default="param", help="param (gradients in the weights' dtype, ZeRO's 16 "
                   "B/param with Adam) or fp32 (Megatron's main gradients, 18 B/param)")
    p.add_argument("--optimizer", default="adam", help="none, sgd, momentum, adam or adamw")
    p.add_argument("--intra-node-bandwidth", default=None, help="per GPU, one way, e.g. 450GB/s (default: "
                   "the estimated GPU's link)")
    p.add_argument("--inter-node-bandwidth", default=None, help="per GPU, one way, e.g. 50GB/s")
    p.add_argument("--link", default=None, metavar="LINK.json", help="the link measured by stageplan link "
                   "(--data-parallel D): its all-reduce prices the sync of replicas within a node")
    p.add_argument("--tensor-parallel", default=None, help="degrees to try, e.g. 1,2,4,8")
    p.add_argument("--pipeline-parallel", default=None, help="pipeline degrees to try (default: every one)")
    p.add_argument("--sequence-parallel", action="store_true", help="with tensor parallelism (Megatron's)")
    p.add_argument("--microbatch-sizes", default=None, help="b to try, e.g. 1,2,4,8")
    p.add_argument("--schedule", default=None, help="schedules to try, e.g. 1F1B,Interleaved1F1B")
    p.add_argument("--virtual-stages", default=None,
                   help="v to try for Interleaved1F1B (default: every valid)")
    p.add_argument("--recompute", default=None, help="none, full or none,full (default both)")
    p.add_argument("--sharding", default=None, help="ddp, zero1, fsdp or a list (default all three)")
    p.add_argument("--context-parallel", type=int, default=1, help="not modelled: only 1 is accepted")
    p.add_argument("--top", type=int, default=10, help="layouts to simulate and list (default 10)")
    p.add_argument("--given", default=None, metavar="tp=4,pp=8,dp=2,mbs=1,sharding=zero1[,vp=5][,sp=1]"
                   "[,layout=L]", help="score a layout you already run beside the best (layout: Megatron's "
                   "--pipeline-model-parallel-layout, last)")
    p.add_argument("--export", default=None, help="print the best layout for torchtitan (TOML), megatron "
                   "(arguments) or deepspeed (JSON config)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("-o", "--output", default=None, metavar="LAYOUT.json", help="where to write the layout")


def _add_profile_command(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser("profile", help="profile every layer of a model -> PROFILE.json",
                       description="Time every layer's forward and backward and measure its memory at one "
                                   "microbatch size.")
    _add_model_args(p)
    p.add_argument("--layers", nargs="+", metavar="PATTERN", help="module FQNs or glob patterns naming the "
                   "layers (default: found automatically)")
    p.add_argument("--microbatch-size", type=int, default=None,
                   help="samples per microbatch (default: a quarter of the batch)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N; or estimate:GPU (e.g. "
                   "estimate:h100-sxm) to estimate every layer for a GPU you do not have, running nothing")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="parameter and input dtype: the model is built under it as torch's default (default: "
                        "the model's own)")
    p.add_argument("--warmup", type=int, default=5, help="rounds run before timing")
    p.add_argument("--repeats", type=int, default=20, help="timed rounds (medians are taken)")
    p.add_argument("--min-time", type=float, default=0.0, metavar="SECONDS",
                   help="time more rounds than --repeats until they span SECONDS, so that the medians "
                   "average out a shared machine's drift (docs/accuracy.md)")
    p.add_argument("--max-time", type=float, default=30.0, metavar="SECONDS",
                   help="stop a slow layer's timed rounds once they span SECONDS and number at least 5, and "
                   "its warm-up after a quarter of it (inf: every round)")
    p.add_argument("--streaming", action="store_true", default=None,
                   help="profile one layer at a time from a model on meta, never holding the whole model "
                   "(default: chosen when the whole model would not fit in free memory)")
    p.add_argument("--no-dedup", action="store_true", help="measure every layer, identical ones too "
                   "(default: with --order layer, identical layers are measured once and their rows say "
                   "measured_as; in the stage order, those between identical neighbours pool their rounds)")
    p.add_argument("--order", choices=["stage", "layer"], default=None,
                   help="stage: time the layers as a stage runs them, every forward in turn and then every "
                   "backward in reverse (a backward follows the next layer's, its activations no longer in "
                   "cache); layer: each backward right after its own forward (default: stage, layer with "
                   "--streaming)")
    p.add_argument("--compute-efficiency", type=float, default=None, metavar="FRACTION",
                   help="with --device estimate:GPU: the fraction of peak FLOP/s matmuls reach (default: "
                        "0.45)")
    p.add_argument("--memory-efficiency", type=float, default=None, metavar="FRACTION",
                   help="with --device estimate:GPU: the fraction of memory bandwidth other ops reach "
                        "(default: 0.7)")
    p.add_argument("--processes", type=int, default=1, metavar="N",
                   help="profile N times, each in a fresh process, one after the other, and keep each "
                   "layer's median: a process's memory layout shifts all its timings alike; 1 profiles in "
                   "this process")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="with --processes: seconds before a profiling process is ended")
    p.add_argument("--quiet", action="store_true", help="no progress and no table")
    p.add_argument("-o", "--output", required=True, metavar="PROFILE.json", help="where to write the profile")
    p.add_argument("--csv", metavar="PROFILE.csv", help="also write the per-layer table as CSV")


def _add_plan_command(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser("plan", help="choose stage boundaries for a profile -> PLAN.json",
                       description="Choose the split that minimises the slowest stage under the memory "
                                   "limits (or with --objective step the predicted step), or evaluate a "
                                   "split you give (--boundaries).")
    p.add_argument("profile", metavar="PROFILE.json", help="a profile written by stageplan profile")
    p.add_argument("--stages", type=int, required=True, help="pipeline ranks (p)")
    p.add_argument("--microbatches", default=None,
                   help="m, or 'auto' (default: batch / profiled microbatch size)")
    p.add_argument("--schedule", default="1F1B", help="1F1B, GPipe, Interleaved1F1B, LoopedBFS, "
                   "InterleavedZeroBubble, ZBVZeroBubble, or auto")
    p.add_argument("--virtual-stages", type=int, default=1,
                   help="v chunks per rank (interleaved schedules only)")
    p.add_argument("--memory-limit", default=None, help="per-rank memory, e.g. 40GiB (default: unlimited)")
    p.add_argument("--bandwidth", default=None, help="link bandwidth between stages, e.g. 25GB/s; B is a "
                   "byte and b a bit: 400Gb/s = 400Gbit/s = 400Gbps = 50GB/s (default: communication not "
                   "modelled)")
    p.add_argument("--link", default=None, metavar="LINK.json", help="the link measured by stageplan link: "
                   "its bandwidth prices boundary bytes, its fused send/receive exchange (or latency) delays "
                   "every crossing (instead of --bandwidth)")
    p.add_argument("--optimizer", default="adam",
                   help="none, sgd, momentum, adam or adamw (sets the memory it holds)")
    p.add_argument("--device-speeds", default=None,
                   help="comma-separated speed per rank, relative to the profiled device")
    p.add_argument("--recompute", action="store_true", help="activation recomputation (checkpointing)")
    p.add_argument("--precision", default=None, help="fp32, bf16, bf16-mixed or fp16-mixed: bytes per "
                   "parameter held in training (mixed with Adam: 16) (default: the profiled parameters' "
                   "bytes)")
    p.add_argument("--data-parallel", type=int, default=1, metavar="D",
                   help="replicas of the pipeline, each training its share of a batch D times the profiled "
                        "one (run starts stages x D ranks; stageplan layout chooses D for N devices)")
    p.add_argument("--sharding", default="ddp", help="what each replica holds: ddp, zero1 (optimizer states "
                   "sharded) or fsdp (parameters, gradients and states sharded; default: ddp)")
    p.add_argument("--method", default=None, help="optimal, uniform or parameters (default: optimal)")
    p.add_argument("--objective", default="bottleneck", help="what the optimal method minimises: bottleneck "
                   "(the slowest rank per microbatch, then the lowest predicted step among ties) or step "
                   "(the lowest predicted step, with the optimizer steps, tied sync, fill and drain; "
                   "default: bottleneck)")
    p.add_argument("--boundaries", default=None, metavar="0,B1,...,L",
                   help="score this split against the optimal plan instead of choosing one (method 'given')")
    p.add_argument("--megatron-layout", default=None, metavar="LAYOUT",
                   help="score Megatron's --pipeline-model-parallel-layout, e.g. 'E,t*5|t*6,L' (E = the "
                        "first layer, t = each named block, L = the last layer; | between stages, *n "
                        "repeats, (...)*n repeats a group)")
    p.add_argument("--fqns", default=None, metavar="FQNS.json",
                   help="score torchtitan's module_fqns_per_model_part: a JSON list of lists of module FQNs, "
                        "one list per stage (as --export torchtitan prints it)")
    p.add_argument("--time-limit", type=float, default=2.0, metavar="SECONDS",
                   help="the solver's time per MILP solve of an interleaved or V plan (--virtual-stages > "
                        "1); a plan that hits it says how close to the proven optimum it is")
    p.add_argument("--compare", action="store_true", help="also print every method side by side")
    p.add_argument("--explain", action="store_true",
                   help="print each note whole (by default a note is cut to one line; the plan's JSON has "
                        "them all)")
    p.add_argument("--export", default=None, help="print the split for another tool: split-spec, torchtitan, "
                   "megatron, deepspeed or torchgpipe (stdout then carries only the export; the table goes "
                   "to stderr)")
    p.add_argument("-o", "--output", default=None, metavar="PLAN.json", help="where to write the plan")


def _add_run_command(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser("run", help="train with a plan on one process per rank; measure, optionally check",
                       description="Train with the plan on local processes (or under torchrun) and compare "
                                   "measured with predicted.")
    _add_model_args(p)
    p.add_argument("--plan", required=True, metavar="PLAN.json", help="a plan written by stageplan plan")
    p.add_argument("--steps", type=int, default=20, help="measured training steps")
    p.add_argument("--warmup", type=int, default=3, help="steps run before measuring")
    p.add_argument("--optimizer", default=None,
                   help="none, sgd, momentum, adam or adamw (default: the plan's)")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: 0.05 for sgd/momentum, 1e-3 for adam/adamw)")
    p.add_argument("--check", action="store_true",
                   help="compare with single-process training; exit 1 on FAIL")
    p.add_argument("--backend", default=None, help="gloo (CPU, default) or nccl (CUDA)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before every rank is ended")
    _add_pin_arg(p)
    p.add_argument("--sharding", default=None, help="how a plan's data-parallel replicas run: ddp, zero1 "
                   "(DDP + ZeroRedundancyOptimizer), fsdp (FSDP2, unsharded until the last microbatch) or "
                   "fsdp-reshard (resharded after every forward) (default: the plan's)")
    p.add_argument("--no-retime", dest="retime", action="store_false", help="skip timing each rank's layers "
                   "alone after the run (which splits its compute ratio into the machine's and the "
                   "pipeline's; a later rank first runs the earlier layers forward once, reading their "
                   "weights)")
    p.add_argument("--log-dir", default=None,
                   help="folder for per-rank logs (default: a temporary folder, removed)")
    p.add_argument("--weights", default=None, metavar="PATH", help="a .safetensors file or an HF model "
                   "folder: each rank reads only its own tensors (default: the factory's own weights, built "
                   "once and saved)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--explain", action="store_true", help="also print the details per rank: the layers "
                   "inside the schedule, the chunk overhead, the waits, the calls after idle (the report's "
                   "JSON has them all)")
    p.add_argument("-o", "--output", default=None, metavar="RUN.json", help="where to write the run report")


def _add_link_command(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser("link", help="measure the link between neighbouring ranks -> LINK.json",
                       description="Ping-pong between ranks r and r+1 on local processes (as run starts "
                                   "them): latency and bandwidth, for stageplan plan --link.")
    p.add_argument("--backend", default=None, help="gloo (CPU, default) or nccl (CUDA)")
    p.add_argument("--ranks", type=int, default=2, help="local ranks (pairs r, r+1 are measured)")
    p.add_argument("--data-parallel", type=int, default=1, metavar="D",
                   help="replicas: lay the ranks out as run does, ranks / D pipeline ranks x D, and also "
                        "time every stage's replicas all-reducing at once, by message size (for plan --link "
                        "--data-parallel)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before every rank is ended")
    _add_pin_arg(p)
    p.add_argument("-o", "--output", required=True, metavar="LINK.json", help="where to write the link")


def _add_calibrate_command(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser("calibrate", help="rescale each layer's times to what a run measured of it",
                       description="Rescale each layer's forward and backward times to what a run measured "
                                   "of that layer inside the real schedule, so the next plan starts from the "
                                   "run.")
    p.add_argument("profile", metavar="PROFILE.json", help="the profile the run's plan was made from")
    p.add_argument("run", metavar="RUN.json", help="a run report written by stageplan run -o")
    p.add_argument("-o", "--output", required=True, metavar="CALIBRATED.json",
                   help="where to write the calibrated profile")


def _add_compare_command(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser("compare", help="profile, plan with every method, run each: what balancing buys",
                       description="Profile the model, plan it with optimal, uniform and parameter-balanced "
                                   "splits, run each distinct split and print predicted vs measured.")
    _add_loop_args(p, steps=10)
    p.add_argument("-o", "--output", default=None, metavar="DIR",
                   help="write compare.json, plans, runs and plots here")


def _add_tune_command(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser("tune",
                       help="profile, plan, run, calibrate, re-plan until the plan settles -> DIR/plan.json",
                       description="Close the loop on this machine: profile, plan, run, calibrate and plan "
                                   "again until the plan stops changing (or --rounds), then measure the "
                                   "final plan on a fresh run and the uniform split once, for reference.")
    # 20 measured steps by default: on a shared 2-core CPU host one plan's median step moved 7-14% between
    # runs of 8 steps and about 3% between runs of 20, and tune compares plans by that median
    _add_loop_args(p, steps=20, warmup=3)
    p.add_argument("--rounds", type=int, default=3, help="most calibrate-and-re-plan rounds")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="write plan.json (the final plan), "
                   "profile.json (the calibrated profile it was planned from), run_final.json and "
                   "run_uniform.json (the median fresh runs) and tune.json here")


def _add_show_command(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser("show", help="print a profile, plan, run report or compare.json (optionally plot it)",
                       description="Print the table of a stageplan file; --plot writes the figure that fits "
                                   "it.")
    p.add_argument("path", metavar="FILE.json", help="a profile, plan, run report or compare.json")
    p.add_argument("--plot", metavar="OUT.png", help="write the figure (.png, .svg or .pdf)")
    p.add_argument("--explain", action="store_true",
                   help="a plan's notes whole (by default each is one line), a run's details per rank")
    p.add_argument("--trace", metavar="OUT.json", help="a plan's predicted step or a run's measured one as "
                   "Chrome trace-event JSON, to open in Perfetto (ui.perfetto.dev): a track per rank")


def _cmd_profile(a: argparse.Namespace) -> int:
    from stageplan._io import check_output_path
    from stageplan.profiling.profiler import build_workload_for_profile, profile_model
    from stageplan.report import profile_table
    from stageplan.workload import default_microbatch_size

    check_output_path(a.output)
    if a.csv:
        check_output_path(a.csv)
        if os.path.realpath(a.csv) == os.path.realpath(a.output):
            raise StageplanError(f"-o and --csv both name {a.output!r}, and the CSV would replace the "
                                 "profile; give the CSV its own path, e.g. --csv profile.csv")
    options = parse_set(a.factory_options)
    measure = {"device": a.device, "dtype": a.dtype, "warmup": a.warmup, "repeats": a.repeats,
               "layers": a.layers,
               "streaming": a.streaming, "dedup": not a.no_dedup, "compute_efficiency": a.compute_efficiency,
               "memory_efficiency": a.memory_efficiency, "min_time_s": a.min_time,
               "order": a.order, "max_time_s": a.max_time}
    if a.processes != 1:
        from stageplan.running.launch import profile_in_processes

        prof = profile_in_processes(a.model, options, processes=a.processes,
                                    microbatch_size=a.microbatch_size,
                                    progress=not a.quiet, timeout_s=a.timeout, **measure)
    else:
        workload = build_workload_for_profile(a.model, options, device=a.device, dtype=a.dtype,
                                              streaming=a.streaming)
        mb = (
            a.microbatch_size
            if a.microbatch_size is not None
            else default_microbatch_size(workload.batch_size)
        )
        prof = profile_model(workload, microbatch_size=mb, progress=not a.quiet, **measure)
    save_or_keep(prof, a.output)
    if a.csv:
        prof.to_csv(a.csv)
    if not a.quiet:
        print(profile_table(prof))
    print(f"wrote {a.output} ({len(prof)} layers)")
    return 0


def _load_any(path: str) -> tuple[str, Any]:
    from stageplan._io import read_json

    data = read_json(path, "input")
    schema = str(data.get("schema", ""))
    if schema.startswith("stageplan.profile/"):
        from stageplan.formats.profile import Profile

        return "profile", Profile.from_json(data, source=f"profile {path!r}")
    if schema.startswith("stageplan.run/"):
        from stageplan.formats.runreport import RunReport

        return "run", RunReport.from_json(data, source=f"run report {path!r}")
    if schema.startswith("stageplan.plan/"):
        from stageplan.formats.plan import Plan

        return "plan", Plan.from_json(data, source=f"plan {path!r}")
    if schema.startswith("stageplan.compare/"):
        _check_compare(data, path)
        return "compare", data
    if schema.startswith("stageplan.layout/"):
        from stageplan.formats.layout import Layout

        return "layout", Layout.from_json(data, source=f"layout {path!r}")
    if schema.startswith("stageplan.tune/"):
        _check_tune(data, path)
        return "tune", data
    if schema.startswith("stageplan.link/"):
        from stageplan.formats.link import load_link

        return "link", load_link(path)
    raise StageplanError(
        f"{path!r} has schema {schema!r}; show reads stageplan profile, plan, run, compare, layout, tune and "
        "link files")


def _check_compare(data: dict[str, Any], path: str) -> None:
    """A compare.json with every field its table reads, of the right kind (SchemaError otherwise)."""
    from stageplan.errors import SchemaError

    methods = data.get("methods")
    rows = methods.items() if isinstance(methods, dict) and methods else None
    need: dict[str, type | tuple[type, ...]] = {"boundaries": list, "predicted_step_s": (int, float),
                                                "balance_efficiency": (int, float), "peak_memory_bytes": list}
    for name, row in rows or [("", None)]:
        bad = [k for k, kind in need.items() if not isinstance(row, dict) or not isinstance(row.get(k), kind)]
        if rows is None or bad:
            what = "no 'methods'" if rows is None else f"method {name!r} lacks or mangles {', '.join(bad)}"
            raise SchemaError(f"compare result {path!r} has {what}; each method needs {', '.join(need)}; "
                              "rerun stageplan compare")


def _check_tune(data: dict[str, Any], path: str) -> None:
    """A tune.json with every field its table reads (SchemaError otherwise)."""
    from stageplan.errors import SchemaError

    rounds = data.get("rounds")
    rows = [*(rounds if isinstance(rounds, list) else [None]), data.get("final"), data.get("uniform")]
    need = ("boundaries", "predicted_step_s", "measured_step_s")
    if not all(isinstance(r, dict) and all(k in r for k in need) for r in rows):
        raise SchemaError(f"tune result {path!r} lacks rounds, final or uniform, each with "
                          f"{', '.join(need)}; rerun stageplan tune")


def _plot(kind: str, obj: Any, path: str) -> None:
    """The figure that fits the file: a profile's layer costs, a plan's balance + memory + simulated timeline,
    a run's measured timeline + predicted vs measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stageplan.plots import (
        check_figure_path,
        plot_layer_costs,
        plot_memory,
        plot_predicted_vs_measured,
        plot_stage_balance,
        plot_timeline,
        save,
    )

    check_figure_path(path)
    if kind in ("compare", "tune", "link"):
        where = ": stageplan compare -o DIR writes its figures" if kind == "compare" else ""
        raise StageplanError(f"show --plot draws profiles, plans and run reports, and this file is a {kind} "
                             f"result{where}; drop --plot {path}")
    if kind == "profile":
        ax = plot_layer_costs(obj)
    elif kind == "layout":
        from stageplan.plots import plot_layouts

        ax = plot_layouts(obj)
    elif kind == "plan":
        _fig, axes = plt.subplots(1, 3, figsize=(16, 4))
        plot_stage_balance(obj, ax=axes[0])
        plot_memory(obj, ax=axes[1])
        plot_timeline(obj.simulate(), ax=axes[2], title="simulated timeline")
        ax = axes[0]
    else:
        _fig, axes = plt.subplots(1, 2, figsize=(14, 4), gridspec_kw={"width_ratios": [2.5, 1]})
        plot_timeline(obj, ax=axes[0])
        plot_predicted_vs_measured(obj, ax=axes[1])
        ax = axes[0]
    save(ax, path)
    plt.close("all")
    print(f"wrote {path}")


def _cmd_show(a: argparse.Namespace) -> int:
    from stageplan.report import (
        compare_run_table,
        link_table,
        plan_table,
        profile_table,
        run_table,
        tune_table,
    )

    if a.trace is not None:
        from stageplan._io import check_output_path

        check_output_path(a.trace, (a.path,))
    kind, obj = _load_any(a.path)
    if a.trace is not None and kind not in ("plan", "run"):
        raise StageplanError(f"--trace draws a step's timeline, and {a.path!r} is a {kind} with none; give a "
                             "plan (stageplan plan ... -o plan.json) or a run report (stageplan run ... -o "
                             "run.json)")
    from stageplan.report import layout_table

    tables: dict[str, Any] = {"profile": profile_table, "plan": plan_table, "run": run_table,
                              "compare": compare_run_table, "layout": layout_table, "tune": tune_table,
                              "link": link_table}
    # first: a file it cannot read leaves an existing figure as it was
    table = tables[kind](obj, explain=a.explain) if kind in ("plan", "run") else tables[kind](obj)
    if a.plot is not None:
        _plot(kind, obj, a.plot)
    if a.trace is not None:
        from stageplan._io import write_json_atomic

        write_json_atomic(a.trace, obj.chrome_trace())
    print(table)
    return 0


def _speeds(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise StageplanError(f"--device-speeds must be comma-separated numbers, got {text!r}; e.g. "
                             f"--device-speeds 1,1,0.5,0.5") from None


def _ints(text: str | None, flag: str, example: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise StageplanError(f"{flag} must be comma-separated whole numbers, got {text!r}; e.g. {flag} "
                             f"{example}") from None


def _microbatches(text: str | None) -> int | str | None:
    if text is None or text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise StageplanError(f"--microbatches must be an integer or auto, got {text!r}; e.g. --microbatches "
                             f"8") from None


# What to do with each export, printed beside it (on stderr, so that stdout carries only the export).
EXPORT_HINTS = {
    "split-spec": "torch.distributed.pipelining split_spec: {FQN: SplitPoint name}; pass "
                  "{k: SplitPoint[v] for k, v in spec.items()} to pipeline(..., split_spec=...)",
    "torchtitan": "torchtitan module_fqns_per_model_part: set it in the job config's parallelism section",
    "megatron": "Megatron-LM: pass as --pipeline-model-parallel-layout",
    "deepspeed": "DeepSpeed PipelineModule parts: stage s holds layers parts[s]..parts[s+1]-1 "
                 "(partition_method='custom' or override _partition_layers)",
    "torchgpipe": "torchgpipe / fairscale balance: pass as GPipe(model, balance=...)",
}


def _cmd_plan(a: argparse.Namespace) -> int:
    import json

    from stageplan._io import check_output_path
    from stageplan.formats.plan import EXPORTS
    from stageplan.formats.profile import Profile
    from stageplan.planning.planner import METHODS, plan
    from stageplan.report import compare_table, plan_table

    # the report prints the plan's notes (main's catch_warnings scopes this)
    warnings.simplefilter("ignore", PlanNote)
    if a.output is not None:
        check_output_path(a.output, (a.profile, a.link, a.fqns))
    if a.export is not None and a.export not in EXPORTS:
        raise StageplanError(f"unknown export {a.export!r}; use one of {', '.join(EXPORTS)}")
    prof = Profile.load(a.profile)
    opts: dict[str, Any] = dict(num_microbatches=_microbatches(a.microbatches), schedule=a.schedule,
                                virtual_stages=a.virtual_stages, memory_limit=a.memory_limit,
                                bandwidth=a.bandwidth,
                                optimizer=a.optimizer, devices=_speeds(a.device_speeds),
                                recompute=a.recompute,
                                precision=a.precision, link=a.link, time_limit_s=a.time_limit,
                                data_parallel=a.data_parallel, sharding=a.sharding)
    result = plan(prof, a.stages, method=a.method, objective=a.objective,
                  boundaries=_ints(a.boundaries, "--boundaries", "0,5,10"),
                  megatron_layout=a.megatron_layout, fqns=a.fqns, **opts)
    export = result.export(a.export) if a.export else None
    table_out = sys.stderr if export is not None else sys.stdout
    print(plan_table(result, explain=a.explain), file=table_out)
    if a.compare:
        from stageplan.comparison import peer_plans

        print(file=table_out)
        rows = {m: plan(prof, a.stages, method=m, objective=a.objective if m == "optimal" else "bottleneck",
                        **opts) for m in METHODS}
        peers, not_applicable = peer_plans(prof, rows["optimal"].num_ranks * rows["optimal"].virtual_stages,
                                           lambda b: plan(prof, a.stages, boundaries=b, **opts))
        print(compare_table({**rows, **peers}, not_applicable), file=table_out)
    if a.output is not None:
        save_or_keep(result, a.output)
        print(f"wrote {a.output}", file=table_out)
    if export is not None:
        print(f"{a.export} export ({EXPORT_HINTS[a.export]}):", file=sys.stderr)
        print(json.dumps(export) if not isinstance(export, str) else export)
    return 0


def _in_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ
                                                      for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _cmd_run(a: argparse.Namespace) -> int:
    from stageplan.materialize import init_empty_weights
    from stageplan.report import run_table
    from stageplan.running.launch import load_plan, run, torchrun_main
    from stageplan.zoo import build_workload

    kwargs: dict[str, Any] = dict(steps=a.steps, warmup=a.warmup, optimizer=a.optimizer, lr=a.lr,
                                  check=a.check,
                                  backend=a.backend, timeout_s=a.timeout, pin_cpus=a.pin_cpus,
                                  retime=a.retime, sharding=a.sharding)
    factory_options = parse_set(a.factory_options)
    if a.output is not None:
        from stageplan._io import check_output_path

        check_output_path(a.output, (a.plan, a.weights))
    the_plan = load_plan(a.plan)  # a plan file, or a layout file's best layout
    if _in_torchrun():
        with init_empty_weights():  # each rank materialises only its own stage
            workload = build_workload(a.model, factory_options)
        report = torchrun_main(workload, the_plan, output=a.output, weights=a.weights, **kwargs)
        if report is None:  # not rank 0
            return 0
    else:
        from stageplan.errors import RunInterrupted

        try:
            report = run(a.model, the_plan, factory_options=factory_options, output=a.output,
                         log_dir=a.log_dir, weights=a.weights, progress=not a.quiet, **kwargs)
        except RunInterrupted as exc:  # Ctrl-C: the steps measured until then, marked partial
            from stageplan.formats.runreport import RunReport

            if isinstance(exc.report, RunReport):
                print(run_table(exc.report, explain=a.explain))
            kept = (f"; partial report written to {exc.output}" if exc.output else
                    "; give -o FILE to keep the partial report" if exc.report is not None else "")
            print(f"stageplan: {exc}{kept}", file=sys.stderr)
            return 130
    print(run_table(report, explain=a.explain))
    if a.output is not None:
        print(f"wrote {a.output}")
    if report.check is not None and not report.check["passed"]:
        return 1
    return 0


def _cmd_link(a: argparse.Namespace) -> int:
    from stageplan.report import link_table
    from stageplan.running.launch import measure_link

    link = measure_link(a.ranks, backend=a.backend, timeout_s=a.timeout, output=a.output, pin_cpus=a.pin_cpus,
                        data_parallel=a.data_parallel)
    print(link_table(link))
    print(f"wrote {a.output}")
    return 0


def _cmd_calibrate(a: argparse.Namespace) -> int:
    from stageplan._io import check_output_path
    from stageplan.calibration import calibrate
    from stageplan.formats.profile import Profile
    from stageplan.formats.runreport import RunReport

    check_output_path(a.output, (a.profile, a.run))
    calibrated = calibrate(Profile.load(a.profile), RunReport.load(a.run))
    save_or_keep(calibrated, a.output)
    cal = calibrated.meta["calibration"]
    if cal["per"] == "layer":
        import statistics

        factors = cal["forward_factors"] + cal["backward_factors"]
        how = (f"each layer's forward and backward scaled to what the run measured of it (factors "
               f"{min(factors):.3f} to {max(factors):.3f}, median {statistics.median(factors):.3f})")
    else:
        how = (f"layer times scaled per rank by {', '.join(f'{f:.3f}' for f in cal['rank_factors'])} "
               f"(measured / predicted; not per layer: "
               f"{cal.get('why', 'the run report has no per-layer times')})")
    if cal.get("tied_sync_ratio") is not None:
        how += (f"; the tied gradients' all-reduce at {cal['tied_sync_ratio']:.3f}x its price, as the run's "
                f"last rank to reach it took it ({cal['tied_sync_measured_s'] * 1e3:.3f} ms)")
    if cal.get("optimizer_factors") is not None:
        how += (f"; the {cal['optimizer']} step per rank at "
                f"{', '.join('-' if f is None else f'{f:.3f}x' for f in cal['optimizer_factors'])} its "
                f"profile above the fixed cost, as the run's ranks took it "
                f"({', '.join(f'{t * 1e3:.3f}' for t in cal['optimizer_measured_s'])} ms)")
    print(f"wrote {a.output}: {how}; boundary latency {cal['boundary_latency_s'] * 1e3:.3f} ms per crossing")
    return 0


def _cmd_compare(a: argparse.Namespace) -> int:
    from stageplan.comparison import compare
    from stageplan.report import compare_run_table

    result = compare(a.model, a.stages, factory_options=parse_set(a.factory_options),
                     num_microbatches=a.microbatches,
                     schedule=a.schedule, steps=a.steps, warmup=a.warmup, profile=a.profile,
                     output_dir=a.output,
                     timeout_s=a.timeout, progress=not a.quiet, pin_cpus=a.pin_cpus, processes=a.processes,
                     runs=a.runs, min_time_s=a.min_time, objective=a.objective, order=a.order)
    print(compare_run_table(result))
    if a.output is not None:
        print(f"wrote {a.output}/compare.json and figures")
    return 0


def _cmd_tune(a: argparse.Namespace) -> int:
    from stageplan.tuning import TUNE_OUTPUTS, tune

    result = tune(a.model, a.stages, factory_options=parse_set(a.factory_options),
                  num_microbatches=a.microbatches,
                  schedule=a.schedule, rounds=a.rounds, steps=a.steps, warmup=a.warmup, profile=a.profile,
                  output_dir=a.output, timeout_s=a.timeout, progress=not a.quiet, pin_cpus=a.pin_cpus,
                  processes=a.processes, runs=a.runs, min_time_s=a.min_time, objective=a.objective,
                  order=a.order)
    from stageplan.report import tune_table

    # each round was printed as it ended (tune's progress line); --quiet printed none, so print them here
    print(tune_table(result, rounds=a.quiet))
    print(f"wrote {', '.join(f'{a.output}/{name}' for name in TUNE_OUTPUTS)}")
    return 0


def _names(text: str | None, flag: str) -> list[str] | None:
    return None if text is None else [x.strip() for x in text.split(",") if x.strip()] or None


def _cmd_layout(a: argparse.Namespace) -> int:
    from stageplan._io import check_output_path
    from stageplan.layouting import layout
    from stageplan.report import layout_table

    warnings.simplefilter("ignore", PlanNote)
    if a.output is not None:
        check_output_path(a.output, (*a.source, a.link))
    recompute = None
    if a.recompute is not None:
        kinds = _names(a.recompute, "--recompute") or []
        bad = [k for k in kinds if k not in ("none", "full")]
        if bad:
            raise StageplanError(f"--recompute takes none, full or none,full, got {a.recompute!r}")
        recompute = [k == "full" for k in kinds]
    source = a.source if len(a.source) > 1 or a.source[0].endswith(".json") else a.source[0]
    result = layout(source, a.devices, global_batch_size=a.global_batch_size, memory_limit=a.memory_limit,
                    devices_per_node=a.devices_per_node, device=a.device,
                    options=parse_set(a.factory_options),
                    precision=a.precision, grad_dtype=a.grad_dtype, optimizer=a.optimizer,
                    intra_node_bandwidth=a.intra_node_bandwidth, inter_node_bandwidth=a.inter_node_bandwidth,
                    tensor_parallel=_ints(a.tensor_parallel, "--tensor-parallel", "1,2,4,8"),
                    sequence_parallel=a.sequence_parallel,
                    microbatch_sizes=_ints(a.microbatch_sizes, "--microbatch-sizes", "1,2,4"),
                    schedules=_names(a.schedule, "--schedule"),
                    virtual_stages=_ints(a.virtual_stages, "--virtual-stages", "2,4"), recompute=recompute,
                    shardings=_names(a.sharding, "--sharding"), top=a.top, given=a.given,
                    context_parallel=a.context_parallel, progress=not a.quiet,
                    pipeline_parallel=_ints(a.pipeline_parallel, "--pipeline-parallel", "4,8"), link=a.link)
    export = result.export(a.export) if a.export else None
    out = sys.stderr if export is not None else sys.stdout
    print(layout_table(result, top=a.top), file=out)
    if a.output is not None:
        save_or_keep(result, a.output)
        print(f"wrote {a.output}", file=out)
    if export is not None:
        print(export)
    return 0


COMMANDS = {"layout": _cmd_layout, "compare": _cmd_compare, "tune": _cmd_tune, "profile": _cmd_profile,
            "plan": _cmd_plan,
            "run": _cmd_run, "link": _cmd_link, "calibrate": _cmd_calibrate, "show": _cmd_show}


class _Terminated(BaseException):
    """SIGTERM or SIGHUP, raised where the main thread is, so that every rank is ended and every temporary
    folder removed on the way out, as on Ctrl-C (the ranks run in their own sessions: a signal to the launcher
    alone left them running, with the weights in /tmp)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _terminate(signum: int, _frame: Any) -> None:
    raise _Terminated(signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 1 run/check failure, 2 bad input, 128 + N on signal N)."""
    import signal
    import threading

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is not None:
                previous[sig] = signal.signal(sig, _terminate)
    from stageplan.workload import IN_CLI

    in_cli = IN_CLI.set(True)  # remedies name the CLI's flags
    try:
        with warnings.catch_warnings():  # restores the caller's way of showing warnings on the way out
            warnings.showwarning = _warn_in_one_line
            return _main(argv)
    except _Terminated as exc:
        print(f"stageplan: terminated by {signal.Signals(exc.signum).name}; any rank processes it started "
              f"were ended",
              file=sys.stderr)
        return 128 + exc.signum
    finally:
        IN_CLI.reset(in_cli)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _warn_in_one_line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                      file: Any = None, line: str | None = None) -> None:
    """A warning as the CLI's other lines read: ``stageplan:
    warning: ...``, without Python's file, line and source."""
    print(f"stageplan: warning: {message}", file=sys.stderr if file is None else file, flush=True)


def _join_negative_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--boundaries -1,4,8`` -> ``--boundaries=-1,4,8``: argparse reads a value that starts with a minus and
    is not a plain number as another option, and would refuse the flag as missing its value instead of letting
    the value's own check name the rule it breaks. Only the subcommand's options that take one value are
    joined, named in full or by a prefix that names one of its options alone (as argparse reads ``--bound``
    for ``--boundaries``)."""
    subs = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})
    command = next((i for i, arg in enumerate(argv) if arg in subs), None)
    if command is None:
        return argv
    options: dict[str, bool] = {}  # each option string of the subcommand: whether it takes one value
    for action in subs[argv[command]]._actions:
        options.update({s: action.nargs is None for s in action.option_strings})

    def takes_one(arg: str) -> bool:
        if arg in options:
            return options[arg]
        named = [s for s in options if arg.startswith("--") and s.startswith(arg)]
        return len(named) == 1 and options[named[0]]

    out = argv[:command + 1]
    i = command + 1
    while i < len(argv):
        if argv[i] == "--":  # what follows is positional
            return out + argv[i:]
        if takes_one(argv[i]) and i + 1 < len(argv) and re.match(r"-[\d.]", argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _main(argv: Sequence[str] | None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(_join_negative_values(parser, list(sys.argv[1:] if argv is None else argv)))
        return COMMANDS[args.command](args)
    except StageplanError as exc:
        print(f"stageplan: error: {exc}", file=sys.stderr)
        return 2
    except RunError as exc:
        print(f"stageplan: run failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stageplan: interrupted", file=sys.stderr)
        return 130
