"""Mutation checks (issue 50): each mutation below breaks one behaviour on purpose, in a copy of the tree, and the tests
that cover its file run there. A mutation the tests still pass SURVIVES: a behaviour nothing checks. Run it after
changing a state machine (cache, positions, storage, graphs, calibration):

    .venv/bin/python tests/mutations.py                     # every mutation, two at a time
    .venv/bin/python tests/mutations.py --list              # names, files, covering tests
    .venv/bin/python tests/mutations.py --only NAME ... -j 1 -- -n 2    # after `--`: arguments for pytest

The copy holds the tracked files as they are in the working tree (uncommitted edits included; `--untracked` adds the
files git does not ignore, e.g. a test file not yet added), laid out as the package installs them (kernels/ as
oscar_hf.kernels), and is imported in place of the venv's editable install. Each mutation replaces one exact
snippet of one file: a snippet found other than exactly once is an error, so that the list follows the code
(when code moves, update the snippet). A test that fails on a mutant kills it only if it passes on an unmutated
copy; one that fails there too (a tree in the middle of a change) is left out and the tests run again.
Exit status: 0 when every mutation was killed, 1 when one survived, 2 on an error (a snippet not found, no covering
test file, a timeout)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# the test files that exercise each part (grep the tests for the module and its classes), quick and focused ones
# first (-x stops at the first failure); files that do not exist yet are skipped with a warning
CACHE_TESTS = ("tests/test_cache_state_machine.py", "tests/test_cache.py", "tests/test_oracle.py",
               "tests/test_attention.py", "tests/test_static_cache.py", "tests/test_generate.py")
GRAPH_TESTS = ("tests/test_graphs.py", "tests/test_cache.py", "tests/test_static_cache.py")
CALIBRATION_TESTS = ("tests/test_calibrate.py", "tests/test_center_keys.py", "tests/test_architectures.py")


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str  # found exactly once in `file`
    new: str
    tests: tuple[str, ...]
    note: str = ""


MUTATIONS = [
    Mutation("graph-replays-first-inputs", "oscar_hf/graphs.py",
             "        torch._foreach_copy_(self.inputs, list(inputs))  # one launch where the inputs share a dtype\n",
             "", GRAPH_TESTS, "every replay of a captured decode graph reuses the inputs of its capture"),
    Mutation("grow-keeps-no-rows", "oscar_hf/storage.py",
             "                history.resize(capacity)\n",
             "                history.allocate(history.codes.shape[0], capacity, history.codes.dtype, "
             "history.codes.device)\n",
             CACHE_TESTS, "a growing history drops the rows already written"),
    Mutation("first-key-block-never-written", "oscar_hf/positions.py",
             "due = (k >= 0) & (excess % b == 0)", "due = (k >= 1) & (excess % b == 0)",
             CACHE_TESTS, "a single-token step never writes the first channel-wise key block"),
    Mutation("wide-channels-over-key-block", "oscar_hf/calibrate.py",
             "blocks = key_blocks[layer] if key_blocks is not None else (config.key_block,) * heads",
             "blocks = (config.key_block,) * heads",
             CALIBRATION_TESTS, "wide key channels fitted for key_block, not the blocks allocated to each head"),
    Mutation("value-clip-from-key-errors", "oscar_hf/calibrate.py",
             'best_ratio(errs["key"]), best_ratio(errs["value"])', 'best_ratio(errs["key"]), best_ratio(errs["key"])',
             CALIBRATION_TESTS, "the value clip is chosen from the key errors"),
    Mutation("crop-skips-sliding-layers", "oscar_hf/cache.py",
             "                layer.crop(tokens_to_remove)\n", "                pass\n",
             CACHE_TESTS[:4] + ("tests/test_architectures.py",) + CACHE_TESTS[4:],
             "crop leaves the sliding-window layers uncropped"),
    # Was "reset keeps high_water" (cache.py: `set_length(0, rollback=True)`). With the ring record that replaces
    # high_water, a reset that kept `ring_positions` would change nothing (a crop first re-records every slot
    # written since the reset); the counterpart is the record's horizon, `recorded`.
    Mutation("reset-keeps-ring-record", "oscar_hf/positions.py",
             '        """No tokens: nothing in the ring."""\n'
             "        self.ring_positions = [-1] * self.ring\n"
             "        self._set_length(0)\n",
             '        """No tokens: nothing in the ring."""\n'
             "        self.ring_positions = [-1] * self.ring\n"
             "        recorded = self.recorded\n"
             "        self._set_length(0)\n"
             "        self.recorded = recorded\n",
             CACHE_TESTS, "reset keeps how far the ring record reaches (was: reset keeps high_water)"),
    Mutation("no-finite-check-on-cpu-steps", "oscar_hf/cache.py",
             '(key_states.shape[2] == 1 and key_states.device.type != "cpu")', "key_states.shape[2] == 1",
             ("tests/test_cache.py", "tests/test_static_cache.py"),
             "NaN/Inf states pass single-token steps on the CPU"),
    # beyond the eight: the layer's clip applied to its wide (4-bit) heads, as before issue 50
    Mutation("wide-rows-clipped", "oscar_hf/quant.py",
             "q4 = quantize_rows(x[:, list(wide)].float(), WIDE_BITS,",
             "q4 = quantize_rows(clip_rows(x[:, list(wide)].float(), fmt.clip), WIDE_BITS,",
             ("tests/test_quant.py", "tests/test_kernels.py") + CALIBRATION_TESTS[:1],
             "a wide head's token-wise rows are clipped at the 2-bit heads' ratio"),
]


def tracked_files(untracked: bool) -> list[str]:
    args = ["git", "-C", str(REPO), "ls-files", "-z", "--cached"]
    args += ["--others", "--exclude-standard"] if untracked else []
    out = subprocess.run(args, check=True, capture_output=True).stdout.decode()
    return sorted({f for f in out.split("\0") if f and (REPO / f).is_file()})  # (a tracked file deleted: none)


def mutated(mutation: Mutation, root: Path) -> str:
    """`mutation.file` under `root`, mutated; ValueError unless the snippet is found there exactly once."""
    path = root / mutation.file
    text = path.read_text() if path.is_file() else ""
    count = text.count(mutation.old)
    if count != 1:
        raise ValueError(f"{mutation.name}: the snippet is found {count} times in {mutation.file}, not once: "
                         f"update it in {Path(__file__).name}\n--- snippet ---\n{mutation.old}")
    return text.replace(mutation.old, mutation.new)


def make_copy(files: list[str], root: Path) -> None:
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, root / f)
    # setup.cfg installs kernels/ as oscar_hf.kernels: without this link the venv's editable install would supply the
    # working tree's kernels to the copy's oscar_hf
    (root / "oscar_hf" / "kernels").symlink_to("../kernels", target_is_directory=True)


def environment(root: Path, threads: int) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])]),
                OMP_NUM_THREADS=str(threads), PYTHONDONTWRITEBYTECODE="1")


def check_imports(root: Path, threads: int) -> None:
    """Raises unless Python started in `root` imports oscar_hf and oscar_hf.kernels from `root`."""
    where = subprocess.run([sys.executable, "-c", "import oscar_hf, oscar_hf.kernels as k; print(oscar_hf.__file__); "
                            "print(k.__file__)"], cwd=root, env=environment(root, threads), capture_output=True,
                           text=True)
    paths = where.stdout.split()
    if where.returncode or len(paths) != 2 or not all(Path(p).is_relative_to(root) for p in paths):
        raise OSError(f"the copy in {root} does not import its own oscar_hf: {where.stdout}{where.stderr[-2000:]}")


def first_failure(output: str) -> str | None:
    """The node id of the first test (or file, for a collection error) in pytest's short summary."""
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ")[0].strip()
    return None


class Runner:
    """Runs mutations on copies of one file list. A test that fails on a mutant kills it only if it passes on an
    unmutated copy (the baseline, copied once): one that fails there too (a working tree in the middle of a change)
    is left out and the mutant's tests run again."""

    MAX_RERUNS = 10

    def __init__(self, files: list[str], pytest_args: list[str], threads: int, timeout: float, keep: bool):
        self.files, self.pytest_args, self.threads, self.timeout, self.keep = files, pytest_args, threads, timeout, keep
        self.lock = threading.Lock()
        self.baseline: Path | None = None
        self.broken: dict[str, bool] = {}  # node id -> fails without any mutation
        self.running: set[subprocess.Popen] = set()

    def pytest(self, root: Path, args: list[str], timeout: float) -> tuple[int, str]:
        """(exit status, output) of pytest run in `root`."""
        with subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=root,
                              env=environment(root, self.threads), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) as proc:
            self.running.add(proc)
            try:
                output, _ = proc.communicate(timeout=max(timeout, 1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise
            finally:
                self.running.discard(proc)
        return proc.returncode, output

    def stop(self) -> None:
        """Ends the tests still running (an interrupted run)."""
        for proc in list(self.running):
            proc.kill()

    def fails_unmutated(self, node: str) -> bool:
        with self.lock:
            if node not in self.broken:
                if self.baseline is None:
                    self.baseline = Path(tempfile.mkdtemp(prefix="oscar-mutation-baseline-"))
                    make_copy(self.files, self.baseline)
                    check_imports(self.baseline, self.threads)
                only = [] if "::" in node else ["--collect-only"]  # a file's collection error: collect it
                status, _ = self.pytest(self.baseline, [*only, node], self.timeout)
                self.broken[node] = status != 0
            return self.broken[node]

    def run(self, mutation: Mutation) -> tuple[str, float, str]:
        """(KILLED | SURVIVED | TIMEOUT | ERROR, seconds, detail)."""
        root = Path(tempfile.mkdtemp(prefix=f"oscar-mutation-{mutation.name}-"))
        start = time.perf_counter()
        try:
            make_copy(self.files, root)
            (root / mutation.file).write_text(mutated(mutation, root))
            tests = [t for t in mutation.tests if (root / t).is_file()]
            check_imports(root, self.threads)
            left_out: list[str] = []
            for _ in range(self.MAX_RERUNS):
                if not tests:
                    return "ERROR", time.perf_counter() - start, "no covering test file exists" + _note(left_out)
                deselect = [a for node in left_out if "::" in node for a in ("--deselect", node)]
                status, output = self.pytest(root, ["-x", "-rfE", *deselect, *self.pytest_args, *tests],
                                             self.timeout - (time.perf_counter() - start))
                with open(root / "pytest.log", "a") as log:
                    log.write(output)
                if status == 0:
                    last = (output.strip().splitlines() or [""])[-1]
                    return "SURVIVED", time.perf_counter() - start, last + _note(left_out)
                node = first_failure(output)
                if status not in (1, 2) or node is None or node in left_out:  # 2: interrupted (a collection error)
                    return "ERROR", time.perf_counter() - start, f"pytest exit status {status}: {output[-2000:]}"
                if not self.fails_unmutated(node):
                    return "KILLED", time.perf_counter() - start, f"by {node}" + _note(left_out)
                left_out.append(node)
                tests = [t for t in tests if t != node]  # a file that does not collect without the mutation either
            return "ERROR", time.perf_counter() - start, "too many tests fail without the mutation" + _note(left_out)
        except subprocess.TimeoutExpired:
            return "TIMEOUT", time.perf_counter() - start, f"tests still running after {self.timeout:.0f} s"
        except (OSError, ValueError) as e:
            return "ERROR", time.perf_counter() - start, str(e)
        finally:
            if self.keep:
                print(f"  (kept {root})", file=sys.stderr)
            else:
                shutil.rmtree(root, ignore_errors=True)

    def close(self) -> None:
        if self.baseline is not None and not self.keep:
            shutil.rmtree(self.baseline, ignore_errors=True)


def _note(left_out: list[str]) -> str:
    return f" ({len(left_out)} failing without the mutation too, left out: {', '.join(left_out)})" if left_out else ""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="arguments after `--` go to pytest (e.g. -- -n 2)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations only")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("-j", "--jobs", type=int, default=2, help="mutations run at once (default 2)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one mutation's tests may take")
    parser.add_argument("--untracked", action="store_true", help="also copy untracked files git does not ignore")
    parser.add_argument("--keep", action="store_true", help="keep each mutated copy (and its pytest.log)")
    args = parser.parse_args(argv)
    names = [m.name for m in MUTATIONS]
    unknown = sorted(set(args.only or []) - set(names))
    if unknown:
        parser.error(f"unknown mutation(s) {unknown}; known: {', '.join(names)}")
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    errors = {}
    for m in chosen:  # every snippet first, against the working tree: a stale list fails before anything runs
        try:
            mutated(m, REPO)
        except ValueError as e:
            errors[m.name] = str(e)
    if args.list:
        for m in chosen:
            stale = "  [SNIPPET NOT FOUND ONCE: update it]" if m.name in errors else ""
            print(f"{m.name}  ({m.file}): {m.note}{stale}\n    tests: {' '.join(m.tests)}")
        return 2 if errors else 0
    if errors:
        print("\n\n".join(errors.values()), file=sys.stderr)
        return 2
    files = tracked_files(args.untracked)
    for m in chosen:
        for t in m.tests:
            if t not in files:
                print(f"warning: {m.name}: skipping {t} (not in the copied tree)", file=sys.stderr)
    jobs = max(1, args.jobs)
    threads = max(1, (os.cpu_count() or 1) // jobs)
    print(f"{len(chosen)} mutation(s), {jobs} at a time, {threads} thread(s) each", flush=True)
    width = max(len(m.name) for m in chosen)
    runner = Runner(files, pytest_args, threads, args.timeout, args.keep)
    results = {}

    def one(m: Mutation):
        results[m.name] = outcome = runner.run(m)
        status, seconds, detail = outcome
        print(f"{m.name:<{width}}  {status:<8}  {seconds:6.0f} s  {detail}", flush=True)

    pool = ThreadPoolExecutor(jobs)
    try:
        list(pool.map(one, chosen))
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)
        runner.stop()
        raise
    finally:
        pool.shutdown()
        runner.close()
    survived = [n for n, (s, _, _) in results.items() if s == "SURVIVED"]
    failed = [n for n, (s, _, _) in results.items() if s in ("ERROR", "TIMEOUT")]
    killed = sum(s == "KILLED" for s, _, _ in results.values())
    print(f"{killed} killed, {len(survived)} survived" + (f": {', '.join(survived)}" if survived else "")
          + (f"; {len(failed)} not decided: {', '.join(failed)}" if failed else ""))
    return 2 if failed else 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
