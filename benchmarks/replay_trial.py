"""Replay a new user's trial end to end on a fresh clone, and check every step.

    python3 benchmarks/replay_trial.py                        # a true fresh clone: make demo installs .venv
    python3 benchmarks/replay_trial.py --venv /path/to/.venv  # link an existing venv instead: a quick rerun
    python3 benchmarks/replay_trial.py --venv /path/to/.venv --only ctrl-c

Steps, in order (--only picks some by name; clone always runs, and without --venv so does demo, since make
demo is what creates the clone's .venv):

  clone      git clone the repository (default: the one holding this script, its HEAD) into a temporary folder
  demo       make demo in the clone: it creates .venv, installs, and prints predicted against measured
  tour       the README's CLI tour from a fresh shell: its setup block from another folder, then each command
  own-model  a factory in the current folder (the README's mymodel.py) profiled, planned and run with --check
  own-loop   the README's own-loop example: its commands make plan.json and model.safetensors, then torchrun
  70b        the README's LLaMA-2-70B estimate and plan: the summary's tokens/s, MFU and "fits" wording
  mistakes   a new user's mistakes: one line on stderr, exit 2, no traceback, naming the rule and the remedy
  ctrl-c     SIGINT during run and compare: exit 130, a partial run report, no rank left, --log-dir reused

Each step prints one line (PASS or FAIL, what it checked, its seconds), with the failed checks under it;
the script exits 1 when any step fails or cannot run. Commands are taken from the README's fenced blocks and
inline code as written, so a README that changes is replayed as it reads. Every command runs in a shell
with a fresh user's environment (no virtual environment active, no PYTHONPATH), in its own process group,
with a timeout that kills the group; a process still running in the replay's folder after its command ended
is reported and killed. Nothing is downloaded except what make demo installs through pip (the Hugging Face
libraries are told to stay offline). Needs Linux (/proc), git, make, bash and python3; uses the standard
library only, since it runs before the clone's .venv exists.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("clone", "demo", "tour", "own-model", "own-loop", "70b", "mistakes", "ctrl-c")
TAIL_LINES = 8  # of a failed command's stderr, shown under its check
# A stored profile measured on a 2-core CPU: the mistakes and Ctrl-C need a gpt plan, not a fresh profile
GPT_PROFILE = "profiles/cpu/gpt.json"
LLAMA_70B = "profiles/estimate/llama2-70b-h100-sxm.json"


class ReadmeChanged(Exception):
    """The README no longer has a section, block or command this replay follows."""


@dataclass
class Done:
    """One command's outcome. ``rc`` is None when it ran past its timeout (its process group was killed);
    ``left`` lists the processes still running in the replay's folder after it ended (they were killed)."""

    label: str
    rc: int | None
    out: str
    err: str
    seconds: float
    left: list[str]

    def tail(self) -> str:
        lines = [line for line in (self.err or self.out).splitlines() if line.strip()]
        return "\n".join(lines[-TAIL_LINES:])


@dataclass
class Step:
    name: str
    summary: str = ""
    checks: list[tuple[bool, str, str]] = field(default_factory=list)  # (passed, what, detail)
    commands: list[Done] = field(default_factory=list)

    def check(self, passed: bool, what: str, detail: str = "") -> bool:
        self.checks.append((bool(passed), what, "" if passed else detail))
        return bool(passed)

    def exited(self, done: Done, rc: int = 0) -> bool:
        """The command ended by itself with exit ``rc`` and left no process running."""
        if done.rc is None:
            return self.check(False, f"{done.label}: finishes", f"timed out after {done.seconds:.0f} s\n"
                                                                 f"{done.tail()}")
        ok = self.check(done.rc == rc, f"{done.label}: exit {rc}", f"exit {done.rc}\n{done.tail()}")
        return self.check(not done.left, f"{done.label}: no process left running",
                          "still running (killed): " + "; ".join(done.left)) and ok

    def one_line_error(self, done: Done, says: list[str], never: tuple[str, ...] = ()) -> None:
        """Exit 2, one line on stderr and no traceback, saying each of ``says`` and none of ``never``."""
        self.exited(done, rc=2)
        lines = [line for line in done.err.splitlines() if line.strip()]
        self.check(len(lines) == 1, f"{done.label}: one line on stderr",
                   f"{len(lines)} lines:\n{done.tail()}")
        self.check("Traceback" not in done.err + done.out, f"{done.label}: no traceback", done.tail())
        for words in says:
            self.check(words in done.err, f"{done.label}: says {words!r}", done.err.strip())
        for words in never:
            self.check(words not in done.err, f"{done.label}: does not say {words!r}", done.err.strip())

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(ok for ok, _, _ in self.checks)


# -- the README, read as a user reads it ---------------------------------------------------------------------

def section(readme: str, title: str) -> str:
    """The text under the ``## title...`` heading, up to the next ``## `` heading."""
    found = re.search(rf"^## {re.escape(title)}[^\n]*\n(.*?)(?=^## |\Z)", readme, flags=re.M | re.S)
    if found is None:
        raise ReadmeChanged(f"the README has no '## {title}' section")
    return found.group(1)


def fenced(text: str) -> list[tuple[str, str]]:
    """The fenced blocks of ``text`` as (language, body)."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S)


def inline(text: str, prefix: str) -> list[str]:
    """Inline code spans outside the fenced blocks that start with ``prefix``."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return [span for span in re.findall(r"`([^`\n]+)`", prose) if span.startswith(prefix)]


def command_lines(block: str) -> list[str]:
    """A block's commands: continuation lines joined, blank and comment-only lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = [line.strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def one(items: list[str], what: str) -> str:
    if len(items) != 1:
        raise ReadmeChanged(f"expected one {what} in the README, found {len(items)}: {items}")
    return items[0]


def option(cmd: str, *names: str) -> str | None:
    """The value of the first of ``names`` in a shell command (``-o x`` or ``--output=x``)."""
    argv = shlex.split(cmd, comments=True)
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


# -- processes -----------------------------------------------------------------------------------------------

def fresh_env(quiet_bytecode: bool) -> dict[str, str]:
    """The environment of a new shell: no virtual environment active (its bin folder off PATH), no PYTHONPATH
    or other PYTHON* setting, and Hugging Face kept offline so that a command that would download fails
    instead. ``quiet_bytecode`` keeps a borrowed venv's editable install from getting new .pyc files."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "CONDA")) and k not in ("PS1", "_OLD_VIRTUAL_PATH")}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and not (Path(p) / "activate").is_file()]
    env["PATH"] = os.pathsep.join(path)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if quiet_bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def processes_in(folder: Path) -> dict[int, str]:
    """Processes (pid: command line) whose working folder is ``folder`` or inside it: every command of the
    replay runs there, and ranks and torchrun's workers inherit it, whatever session they start."""
    found: dict[int, str] = {}
    inside = str(folder) + os.sep
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone, a zombie, or not ours
            continue
        if cmd and (cwd == str(folder) or cwd.startswith(inside)):
            found[int(entry.name)] = cmd
    return found


def still_running(folder: Path, grace_s: float = 3.0) -> dict[int, str]:
    """``processes_in`` once the ones on their way out had ``grace_s`` to go."""
    deadline = time.monotonic() + grace_s
    while (left := processes_in(folder)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill(pids: dict[int, str]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def killpg(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def wait_for(path: Path, pattern: str, proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether a line matching ``pattern`` appears in ``path`` within ``timeout_s``, while ``proc`` runs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if re.search(pattern, path.read_text(errors="replace"), flags=re.M):
            return True
        if proc.poll() is not None:
            return bool(re.search(pattern, path.read_text(errors="replace"), flags=re.M))
        time.sleep(0.05)
    return False


class Replay:
    """The temporary folder, the clone in it, and how its commands run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.repo: str = args.repo
        self.borrowed = Path(args.venv).absolute() if args.venv else None
        self.base = Path(tempfile.mkdtemp(prefix="stageplan-replay-", dir=args.tmp)).resolve()
        self.clone = self.base / "stageplan"
        self.venv = self.clone / ".venv"
        self.logs = self.base / "logs"
        self.logs.mkdir()
        self.env = fresh_env(quiet_bytecode=self.borrowed is not None)
        self.verbose: bool = args.verbose
        self.count = 0
        self.readme = ""

    def folder(self, name: str) -> Path:
        path = self.base / name
        path.mkdir(exist_ok=True)
        return path

    def start(self, step: Step, script: str, cwd: Path, *,
              activate: bool = True) -> tuple[subprocess.Popen[bytes], Path, Path]:
        """``script`` in a new bash (no profile, no rc) with the clone's .venv activated, as the README says,
        in a session of its own; stdout and stderr go to files under logs/."""
        self.count += 1
        stem = self.logs / f"{self.count:02d}-{step.name}"
        out_path, err_path = stem.with_suffix(".out"), stem.with_suffix(".err")
        full = f". {shlex.quote(str(self.venv / 'bin' / 'activate'))} && {script}" if activate else script
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(["bash", "--noprofile", "--norc", "-c", full], cwd=cwd, stdout=out,
                                    stderr=err, stdin=subprocess.DEVNULL, env=self.env,
                                    start_new_session=True)
        return proc, out_path, err_path

    def sh(self, step: Step, script: str, cwd: Path, timeout_s: float, *, label: str | None = None,
           activate: bool = True) -> Done:
        start = time.monotonic()
        proc, out_path, err_path = self.start(step, script, cwd, activate=activate)
        rc: int | None = None
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        except BaseException:  # this script interrupted: end the command's group before going
            killpg(proc.pid)
            raise
        return self.finish(step, label or script, proc, rc, out_path, err_path, start)

    def finish(self, step: Step, label: str, proc: subprocess.Popen[bytes], rc: int | None, out_path: Path,
               err_path: Path, start: float) -> Done:
        """The command's outcome; what it left running (looked for before anything is killed) is killed with
        its process group, and with the group alone when it timed out (``rc`` None)."""
        seconds = time.monotonic() - start
        left = still_running(self.base) if rc is not None else {}
        killpg(proc.pid)
        proc.wait()
        kill(left | processes_in(self.base))
        done = Done(label, rc, out_path.read_text(errors="replace"), err_path.read_text(errors="replace"),
                    seconds, [f"{pid} {cmd[:120]}" for pid, cmd in left.items()])
        step.commands.append(done)
        if self.verbose:
            print(f"    [{seconds:6.1f} s, exit {rc}] {label}", flush=True)
        return done

    def stageplan_python(self, step: Step, code: str, cwd: Path, *args: str, timeout_s: float = 120) -> Done:
        """``python -c code args`` with the activated environment's python."""
        return self.sh(step, shlex.join(["python", "-c", code, *args]), cwd, timeout_s,
                       label=f"python -c ... {' '.join(args)}".strip())

    def close(self, keep: bool) -> None:
        kill(processes_in(self.base))
        if keep:
            print(f"kept {self.base} (command outputs in {self.logs})")
        else:
            shutil.rmtree(self.base, ignore_errors=True)


# -- the steps -----------------------------------------------------------------------------------------------

def step_clone(r: Replay, s: Step) -> None:
    done = r.sh(s, shlex.join(["git", "clone", "--quiet", r.repo, str(r.clone)]), r.base, 600,
                label=f"git clone {r.repo}", activate=False)
    if not s.exited(done):
        return
    head = subprocess.run(["git", "-C", str(r.clone), "rev-parse", "HEAD"], capture_output=True, text=True,
                          timeout=60).stdout.strip()
    source = subprocess.run(["git", "ls-remote", r.repo, "HEAD"], capture_output=True, text=True,
                            timeout=60).stdout.split()
    s.check(bool(source) and head == source[0], "the clone is at the repository's HEAD",
            f"clone {head}, source {source}")
    r.readme = (r.clone / "README.md").read_text()
    s.check("## CLI tour" in r.readme, "the clone has its README")
    dirty = Path(r.repo).is_dir() and subprocess.run(
        ["git", "-C", r.repo, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
        text=True, timeout=60).stdout.strip()
    s.summary = f"git clone {r.repo}: HEAD {head[:10]}" + (" (the source's uncommitted changes are not in it)"
                                                            if dirty else "")
    if r.borrowed is not None:
        # --venv: the clone gets the venv as .venv and nothing else changes (no make, no install)
        s.check((r.borrowed / "bin" / "stageplan").is_file(), f"--venv {r.borrowed} has bin/stageplan")
        r.venv.symlink_to(r.borrowed, target_is_directory=True)
        s.summary += f"; .venv -> {r.borrowed}"


def step_demo(r: Replay, s: Step) -> None:
    if r.borrowed is None:
        done = r.sh(s, "make demo", r.clone, 2400, activate=False)
    else:
        # make demo's recipe without its install step: with a borrowed venv, make would see the fresh clone's
        # setup.cfg newer than the venv's stamp and pip install this clone into that venv
        done = r.sh(s, "PYTHONUNBUFFERED=1 .venv/bin/python benchmarks/demo.py", r.clone, 1200,
                    label="make demo's recipe (benchmarks/demo.py)", activate=False)
    s.exited(done)
    s.check(os.access(r.venv / "bin" / "stageplan", os.X_OK), ".venv/bin/stageplan exists")
    rows = {m: re.search(rf"^\s*{m}: step predicted\s+[\d.]+ ms, measured\s+[\d.]+ ms, measured/predicted "
                         rf"[\d.]+$", done.out, flags=re.M) for m in ("optimal", "uniform")}
    for method, row in rows.items():
        s.check(row is not None, f"the demo prints {method}'s predicted and measured step", done.out[-1500:])
    speedup = re.search(r"^measured speed-up of optimal over uniform.*?([\d.]+)x \(predicted ([\d.]+)x\)",
                        done.out, flags=re.M)
    s.check(speedup is not None, "the demo prints the measured and predicted speed-up", done.out[-1500:])
    if speedup and float(speedup[1]) < 1 < float(speedup[2]):  # such a reversal is never left bare
        s.check(re.search(r"^note: ", done.out, flags=re.M) is not None,
                "a measured slow-down against a predicted speed-up is explained (a note)", done.out[-1500:])
    passes = len(re.findall(r"^check: PASS", done.out, flags=re.M))
    s.check(passes == 2, "both demo runs match single-process training (check: PASS twice)",
            f"{passes} PASS lines")
    # from a folder of its own: in the replay's folder the clone, named stageplan, would be imported instead
    where = r.stageplan_python(s, "import stageplan; print(stageplan.__file__)", r.folder("home"))
    origin = where.out.strip()
    if r.borrowed is None:
        s.check(origin.startswith(str(r.clone) + os.sep), "the clone's .venv imports the clone's stageplan",
                origin)
    s.summary = (f"{done.label}: exit {done.rc}; predicted vs measured for optimal and uniform, check PASS x"
                 f"{passes}" + (f"; speed-up {speedup[1]}x (predicted {speedup[2]}x)" if speedup else "")
                 + f"; stageplan from {Path(origin).parent}")
    if done.rc == 0:
        warning = re.search(r"^warning: ([^;\n]*)", done.out, flags=re.M)  # its first clause: the why
        if warning:
            s.summary += f"; it warned: {warning[1]}"


def step_tour(r: Replay, s: Step) -> None:
    text = section(r.readme, "CLI tour")
    blocks = fenced(text)
    setup = one([body for lang, body in blocks if lang == "bash"], "```bash block in the CLI tour")
    commands = [c for lang, body in blocks if lang == "sh" for c in command_lines(body)]
    if len(commands) < 10:
        raise ReadmeChanged(f"the CLI tour's ```sh blocks hold {len(commands)} commands")
    # the README's scratch folder is one per machine; the replay's own keeps reruns and other users apart
    scratch = r.base / "tour"
    if "/tmp/tour" not in setup:
        raise ReadmeChanged("the tour's setup block no longer makes /tmp/tour, which this replay moves into "
                            "its own folder")
    setup = setup.replace("/tmp/tour", str(scratch))
    elsewhere = r.folder("home")  # "from any folder": not the clone's root
    done = r.sh(s, f"cd {shlex.quote(str(elsewhere))}\n{setup}\n"
                   'printf "%s\\n" "$PWD" "$REPO" "$(command -v stageplan)"', elsewhere, 60,
                label="the tour's setup block")
    if not s.exited(done):
        return
    where = done.out.strip().splitlines()[-3:]
    s.check(len(where) == 3 and where[0] == str(scratch), "the setup block ends in the scratch folder",
            str(where))
    stageplan = r.venv / "bin" / "stageplan"
    s.check(len(where) == 3 and Path(where[2]).resolve() == stageplan.resolve(),
            "stageplan is on PATH once .venv is activated", str(where))
    if r.borrowed is None:
        s.check(len(where) == 3 and Path(where[1]) == r.clone, "$REPO is the clone", str(where))
    s.check((scratch / GPT_PROFILE).is_file(), "profiles/ is linked into the scratch folder")
    slowest = (0.0, "")
    for cmd in commands:
        done = r.sh(s, cmd, scratch, 900, label=cmd.split("  #")[0].strip())
        slowest = max(slowest, (done.seconds, " ".join(done.label.split()[:2])))
        if s.exited(done):
            for out in filter(None, (option(cmd, "-o", "--output"), option(cmd, "--plot"),
                                     option(cmd, "--trace"))):
                s.check((scratch / out).exists(), f"{done.label}: writes {out}")
    passed = sum(1 for ok, what, _ in s.checks if ok and what.endswith(": exit 0")) - 1  # less the setup's
    outputs = sum(1 for ok, what, _ in s.checks if ok and ": writes " in what)
    s.summary = (f"setup block run from another folder; {passed} of {len(commands)} README commands exit 0 "
                 f"in the scratch folder, {outputs} outputs written; slowest {slowest[1]} {slowest[0]:.0f} s")


def step_own_model(r: Replay, s: Step) -> None:
    text = section(r.readme, "Your own model from the CLI")
    factory = one([body for lang, body in fenced(text) if lang == "python" and "def build(" in body],
                  "```python block defining build")
    profile = one(inline(text, "stageplan profile "), "`stageplan profile` command")
    run = one(inline(text, "stageplan run "), "`stageplan run` command")
    spec = shlex.split(profile)[2]
    module = spec.split(":")[0]
    profile_out, plan_file = option(profile, "-o", "--output"), option(run, "--plan")
    if profile_out is None or plan_file is None:
        raise ReadmeChanged(f"expected -o in {profile!r} and --plan in {run!r}")
    here = r.folder("own-model")
    (here / f"{module}.py").write_text(factory)
    s.check("PYTHONPATH" not in r.env, "no PYTHONPATH in the environment")
    # "plan and run it as gpt above": the tour plans 2 stages of 4 microbatches and runs 4 steps with --check
    for cmd in (profile, f"stageplan plan {profile_out} --stages 2 --microbatches 4 -o {plan_file}",
                f"{run} --steps 4 --warmup 1 --check"):
        done = r.sh(s, cmd, here, 600)
        if not s.exited(done):
            return
    s.check(re.search(r"^check: PASS", done.out, flags=re.M) is not None,
            "the run matches one process (check: PASS)", done.out[-800:])
    model = json.loads((here / profile_out).read_text()).get("meta", {}).get("model")
    s.check(model == spec, f"the profile is of {spec}", f"its meta says {model!r}")
    s.summary = (f"README's {module}.py in the current folder, no PYTHONPATH: {profile.split(' -o')[0]}, "
                 f"plan, run --check (checked: exit 0, check: PASS)")


def step_own_loop(r: Replay, s: Step) -> None:
    text = section(r.readme, "Your own training loop")
    blocks = fenced(text)
    setup = one([body for lang, body in blocks if lang == "bash"], "```bash block making the loop's inputs")
    code = one([body for lang, body in blocks if lang == "python"], "```python block (the loop)")
    names = sorted({span for span in inline(text, "") if " " not in span})
    script = one([name for name in names if name.endswith(".py")], "script name")
    launch = one(inline(text, "torchrun "), "`torchrun` command")
    inputs = [name for name in names if name.endswith((".json", ".safetensors"))]
    here = r.folder("own-loop")
    (here / script).write_text(code)
    done = r.sh(s, f"set -e\n{setup}", here, 600, label="the own-loop's ```bash block")
    if not s.exited(done):
        return
    for name in inputs:
        s.check((here / name).is_file(), f"the block makes {name}")
    done = r.sh(s, launch, here, 600)
    if not s.exited(done):
        return
    # one line a step, or one a step and replica (a loop over data-parallel replicas): a step's loss is the
    # replicas' mean
    by_step: dict[int, list[float]] = {}
    for step, _, x in re.findall(r"^step (\d+)(?: replica (\d+))? loss (\S+)$", done.out, flags=re.M):
        by_step.setdefault(int(step), []).append(float(x))
    losses = [sum(v) / len(v) for _, v in sorted(by_step.items())]
    steps = re.search(r"for step in range\((\d+)\)", code)
    want = int(steps[1]) if steps else max(1, len(losses))
    s.check(len(losses) == want and all(math.isfinite(x) for x in losses),
            f"{script} prints {want} finite losses", done.out[-800:])
    s.summary = (f"README's block made {', '.join(inputs)}; {launch}: exit 0, losses "
                 + " ".join(f"{x:.4f}" for x in losses))


def step_70b(r: Replay, s: Step) -> None:
    text = section(r.readme, "Models bigger than the machine")
    commands = [c for lang, body in fenced(text) if lang in ("text", "sh", "bash")
                for c in command_lines(body) if c.startswith("stageplan ")]
    plan_cmd = one([c for c in commands if c.startswith("stageplan plan ")], "70B `stageplan plan` command")
    if not any(c.startswith("stageplan profile ") for c in commands):
        raise ReadmeChanged("the 70B section has no `stageplan profile` command")
    here = r.folder("70b")
    done = None
    for cmd in commands:
        done = r.sh(s, cmd, here, 900, label=" ".join(cmd.split()[:3]) + " ...")
        if not s.exited(done):
            return
    assert done is not None
    out = done.out
    tokens = re.search(r"([\d,]+) tokens/s", out)
    mfu = re.search(r"MFU ([\d.]+%)", out)
    limit = (option(plan_cmd, "--memory-limit") or "").removesuffix("GiB")
    fits = re.search(rf"memory: fits {re.escape(limit)}(?:\.0)? GiB: fullest rank [\d.]+ GiB", out)
    s.check(tokens is not None, "the summary says tokens/s", out[-1500:])
    s.check(mfu is not None, "the summary says MFU", out[-1500:])
    s.check(fits is not None, f"the summary says 'fits {limit} GiB: fullest rank ... GiB'", out[-1500:])
    s.check("to run this model" not in out, "no note on how to run the estimate here", out[-1500:])
    s.summary = (f"{len(commands)} README commands exit 0; {option(plan_cmd, '--stages')} stages: "
                 f"{tokens[1] if tokens else '?'} tokens/s, MFU {mfu[1] if mfu else '?'}, "
                 f"{fits[0].removeprefix('memory: ') if fits else 'no fits line'}")


def step_mistakes(r: Replay, s: Step) -> None:
    here = r.folder("mistakes")
    gpt, big = r.clone / GPT_PROFILE, r.clone / LLAMA_70B
    if not s.exited(r.sh(s, f"stageplan plan {gpt} --stages 2 --microbatches 4 -o plan.json", here, 120,
                         label="stageplan plan (gpt, for the mistakes)")):
        return
    # a gpt plan run with the convnet: the model's name, before any microbatch or shape check
    s.one_line_error(r.sh(s, "stageplan run convnet --plan plan.json --steps 2 --warmup 1", here, 300),
                     ["plan made for 'gpt'"], never=("microbatch",))
    # argparse's error names the program once
    done = r.sh(s, "stageplan plan plan.json --stages two", here, 60)
    s.one_line_error(done, ["argument --stages", "'two'"])
    s.check(done.err.startswith("stageplan: error: ") and not re.search(r"error: stageplan\b", done.err),
            "--stages two: the program is named once", done.err.strip())
    # a remedy already taken is not offered; without --recompute the same refusal offers it
    tight = f"stageplan plan {big} --stages 8 --microbatches 64 --memory-limit 80GiB"
    s.one_line_error(r.sh(s, f"{tight} --recompute", here, 120), ["--memory-limit"], never=("recomput",))
    s.one_line_error(r.sh(s, tight, here, 120), ["--recompute"])
    # a factory option's remedy in the reader's words: --set on the CLI, factory_options= in Python
    s.one_line_error(r.sh(s, "stageplan run gpt --set n_layer=4 --plan plan.json --steps 2 --warmup 1", here,
                          300), ["--set n_layer=4"], never=("factory_options",))
    api = ("import stageplan\nfrom stageplan.errors import StageplanError\ntry:\n"
           "    stageplan.run('gpt', 'plan.json', factory_options={'n_layer': 4}, steps=2, warmup=1)\n"
           "except StageplanError as exc:\n    print(exc)\nelse:\n    raise SystemExit('no error raised')\n")
    done = r.stageplan_python(s, api, here, timeout_s=300)
    if s.exited(done):
        s.check("factory_options={'n_layer': 4}" in done.out and "--set" not in done.out,
                "stageplan.run(factory_options=...): its error says factory_options=, not --set", done.out)
    # show reads the files tune and link write: the tour's if it ran, else made here
    tour = r.base / "tour"
    tune_json, link_json = tour / "tune" / "tune.json", tour / "link.json"
    if not (tune_json.is_file() and link_json.is_file()):
        tune_json, link_json = here / "tune" / "tune.json", here / "link.json"
        s.exited(r.sh(s, "stageplan link --ranks 2 -o link.json", here, 300))
        s.exited(r.sh(s, f"stageplan tune gpt --stages 2 --rounds 1 --steps 3 --warmup 1 --profile {gpt} "
                         f"-o tune", here, 900))
    done = r.sh(s, f"stageplan show {tune_json}", here, 60)
    if s.exited(done):
        s.check(re.match(r"round 1: boundaries \[", done.out) is not None, "show tune.json: its rounds",
                done.out[:500])
    done = r.sh(s, f"stageplan show {link_json}", here, 60)
    if s.exited(done):
        s.check("latency" in done.out and "bandwidth" in done.out, "show link.json: latency and bandwidth",
                done.out[:500])
    compare_over_a_limit(r, s, here, big)
    errors = sum(1 for _, what, _ in s.checks if what.endswith(": exit 2"))
    s.summary = (f"checked {errors} refusals for exit 2, one line, the expected words (convnet with a gpt "
                 f"plan, --stages two, --recompute's remedies, --set vs factory_options=); show of tune.json "
                 f"and link.json; plan --compare's rows over 80 GiB")


def compare_over_a_limit(r: Replay, s: Step, here: Path, big: Path) -> None:
    """The README's 70B plan with --compare: every row says whether it fits, and by how much it does not,
    consistently with its own peak memory; at least one peer's row is over (uniform is, on this profile)."""
    limit_gib = 80
    done = r.sh(s, f"stageplan plan {big} --stages 16 --microbatches 64 --recompute --memory-limit "
                   f"{limit_gib}GiB --precision bf16-mixed --optimizer adam --compare", here, 120)
    if not s.exited(done):
        return
    rows = re.findall(r"^(\S+)\s+(?:\d+ )+\d+\s+.*?([\d.]+)\s+(yes|NO, ([\d.]+) GiB over)\s*$", done.out,
                      flags=re.M)
    s.check(len(rows) >= 4, "plan --compare: its rows say whether they fit", done.out[-1500:])
    over = []
    for name, mem_mib, verdict, by in rows:
        excess = float(mem_mib) / 1024 - limit_gib
        if verdict == "yes":
            s.check(excess <= 0, f"plan --compare: {name} fits",
                    f"{mem_mib} MiB, over {limit_gib} GiB, said yes")
        else:
            over.append(name)
            s.check(abs(float(by) - excess) <= 0.06, f"plan --compare: {name} is {by} GiB over",
                    f"its peak {mem_mib} MiB is {excess:.2f} GiB over")
    s.check(bool(over), "plan --compare: some row is over 80 GiB (uniform is, on this profile)",
            done.out[-1500:])
    named = re.search(r"^over the memory limit: (.*)$", done.out, flags=re.M)
    s.check(named is not None and all(n in named[1] for n in over),
            "plan --compare: a line names every row over the limit", done.out[-1500:])


def step_ctrl_c(r: Replay, s: Step) -> None:
    here = r.folder("ctrl-c")
    gpt = r.clone / GPT_PROFILE
    if not s.exited(r.sh(s, f"stageplan plan {gpt} --stages 2 --microbatches 4 -o plan.json", here, 120,
                         label="stageplan plan (gpt, for Ctrl-C)")):
        return
    helped = r.sh(s, "stageplan run --help", here, 60)
    progress = " --progress" if "--progress" in helped.out else ""  # progress is on by default otherwise
    run = f"stageplan run gpt --plan plan.json --steps 50 --warmup 1 -o run.json --log-dir logs{progress}"
    interrupt(r, s, here, run, r"^run: step 3/50\b")
    read = ("import json, sys, stageplan\n"
            "print(json.dumps(stageplan.RunReport.load(sys.argv[1]).meta.get('partial')))")
    if s.check((here / "run.json").is_file(), "run.json written after Ctrl-C") and s.exited(
            partial := r.stageplan_python(s, read, here, "run.json")):
        meta = json.loads(partial.out.strip() or "null")
        measured = meta.get("steps_measured") if isinstance(meta, dict) else None
        s.check(isinstance(measured, int) and 1 <= measured < 50 and meta.get("steps_asked") == 50,
                "run.json is a RunReport whose meta['partial'] has 1 <= steps_measured < 50, steps_asked 50",
                f"meta['partial'] = {meta!r}")
    # the same --log-dir again: the tool's own logs are replaced
    start = time.time()
    done = r.sh(s, "stageplan run gpt --plan plan.json --steps 2 --warmup 1 -o run2.json --log-dir logs",
                here, 300, label="run again with the same --log-dir logs")
    if s.exited(done):
        log = here / "logs" / "rank0.log"
        s.check(log.is_file() and log.stat().st_mtime >= start - 1, "logs/rank0.log replaced by the rerun")
    # a file of that name that the tool did not write is refused, and left as it was
    foreign = r.folder("ctrl-c/foreign") / "rank0.log"
    foreign.write_text("notes of my own\n")
    s.one_line_error(r.sh(s, "stageplan run gpt --plan plan.json --steps 2 --warmup 1 --log-dir foreign",
                          here, 300, label="run with a --log-dir holding a foreign rank0.log"), ["rank0.log"])
    s.check(foreign.read_text() == "notes of my own\n", "the foreign rank0.log is left as it was")
    # compare interrupted before it has written anything leaves no output folder
    interrupt(r, s, here, f"stageplan compare gpt --stages 2 --steps 50 --warmup 1 --profile {gpt} -o cmp",
              r"^compare: 0/\d+ running", wait_for_folder=here / "cmp")
    s.check(not (here / "cmp").exists(), "compare interrupted leaves no cmp folder",
            str(sorted(p.name for p in (here / "cmp").rglob("*"))) if (here / "cmp").exists() else "")
    s.summary = ("checked SIGINT to run at step 3/50 and to compare: exit 130, no rank left, a partial "
                 "run.json; the same --log-dir reused, a foreign rank0.log refused; no cmp folder left")


def interrupt(r: Replay, s: Step, here: Path, cmd: str, ready: str, *,
              wait_for_folder: Path | None = None) -> None:
    """Start ``cmd``, wait for a stderr line matching ``ready``, send SIGINT to the CLI process alone (the one
    a terminal's Ctrl-C reaches: its ranks run in sessions of their own), and check it exits 130 with no
    traceback and no process of it left running."""
    label = " ".join(cmd.split()[:2]) + " interrupted"
    start = time.monotonic()
    proc, out_path, err_path = r.start(s, f"exec {cmd}", here)  # exec: the pid is the CLI's
    rc: int | None = None
    try:
        seen = wait_for(err_path, ready, proc, 300)
        if wait_for_folder is not None:
            deadline = time.monotonic() + 10
            while seen and not wait_for_folder.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        if s.check(seen, f"{label}: {ready!r} on stderr before the signal",
                   f"exit {proc.poll()}\n{err_path.read_text(errors='replace')[-800:]}"):
            # its ranks are running (compare prints its line just before it starts them), so that "none
            # left" below means they were ended
            deadline = time.monotonic() + 30
            while len(ranks := {pid: c for pid, c in processes_in(here).items() if pid != proc.pid}) < 2 \
                    and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            s.check(len(ranks) >= 2, f"{label}: its ranks seen running before the signal", str(ranks))
            os.kill(proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                rc = proc.wait(timeout=60)
    except BaseException:
        killpg(proc.pid)
        raise
    if rc is None:  # it ended before its line came, or did not end after the signal (None)
        rc = proc.poll()
    done = r.finish(s, label, proc, rc, out_path, err_path, start)
    s.exited(done, rc=130)
    s.check("Traceback" not in done.err, f"{label}: no traceback", done.tail())


STEP_FUNCTIONS: dict[str, Callable[[Replay, Step], None]] = {
    "clone": step_clone, "demo": step_demo, "tour": step_tour, "own-model": step_own_model,
    "own-loop": step_own_loop, "70b": step_70b, "mistakes": step_mistakes, "ctrl-c": step_ctrl_c,
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="steps: " + ", ".join(STEPS))
    p.add_argument("--repo", default=str(ROOT), help="what to clone (default: %(default)s, its HEAD)")
    p.add_argument("--venv", default=None, metavar="PATH",
                   help="link this existing venv into the clone as .venv instead of make demo's install")
    p.add_argument("--only", default=None, metavar="STEP[,STEP]",
                   help="run only these steps (clone always runs; without --venv so does demo)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder and the commands' outputs")
    p.add_argument("--tmp", default=None, metavar="DIR", help="where to make the temporary folder")
    p.add_argument("-v", "--verbose", action="store_true", help="print every command and check")
    args = p.parse_args(argv)
    if args.only is not None:
        wanted = [x.strip() for x in args.only.split(",") if x.strip()]
        unknown = [x for x in wanted if x not in STEPS]
        if unknown or not wanted:
            p.error(f"--only takes steps among {', '.join(STEPS)}; got {args.only!r}")
        args.only = set(wanted)
    if args.venv is not None and not (Path(args.venv) / "bin" / "activate").is_file():
        p.error(f"--venv {args.venv}: no bin/activate there")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    needed = {"clone"} | (set() if args.venv else {"demo"})
    selected = [name for name in STEPS if args.only is None or name in args.only | needed]
    replay = Replay(args)
    print(f"replaying a new user's trial in {replay.base}: {', '.join(selected)}", flush=True)
    start, failed = time.monotonic(), 0
    try:
        for name in selected:
            step = Step(name)
            began = time.monotonic()
            # the demo makes the clone's .venv (or finds the borrowed one); every later step runs in it
            ready = replay.readme and (name == "demo" or (replay.venv / "bin" / "activate").is_file())
            if name != "clone" and not ready:
                print(f"FAIL  {name:<9}  not run: no clone with a .venv (0.0 s)", flush=True)
                failed += 1
                continue
            try:
                STEP_FUNCTIONS[name](replay, step)
            except ReadmeChanged as exc:
                step.check(False, "the README as this replay reads it", str(exc))
            except Exception as exc:  # a bug here, not in the tool: say so, and go on to the next step
                step.check(False, "the replay script itself", f"{type(exc).__name__}: {exc}")
            failed += not step.passed
            verdict = "PASS" if step.passed else "FAIL"
            print(f"{verdict}  {name:<9}  {step.summary or 'no summary'} ({time.monotonic() - began:.1f} s)",
                  flush=True)
            for ok, what, detail in step.checks:
                if not ok or args.verbose:
                    print(f"      {'ok' if ok else 'FAILED'}: {what}", flush=True)
                    for line in detail.splitlines()[:TAIL_LINES + 2]:
                        print(f"          {line}", flush=True)
    finally:
        replay.close(keep=args.keep)
    print(f"total: {len(selected) - failed} of {len(selected)} steps passed in "
          f"{time.monotonic() - start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
