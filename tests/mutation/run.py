"""Mutation testing of the modules that guard integrity, each against its own tests (`make mutate`).

Each mutant is one small change to one module (a comparison's boundary moved, an operator swapped, a condition
negated, a constant changed, a loop made to run zero times...), written into the module's file in place by
cosmic-ray, and the module's own test files are run against it: a failing run kills the mutant, a passing one
lets it survive. In place, because many of these tests start real daemons (`sys.executable -m
kvstore.server.main`): the daemon imports the same file, so it runs the mutant too. The file is put back after
each mutant, and checked byte for byte at the end.

    python -m tests.mutation.run [MODULE ...] [--python PY] [--list] [--survivors]

A surviving mutant is either a test missing (write one that kills it) or an equivalent mutant, one no test can
tell from the original: those are listed with the reason in `equivalent.toml` beside this file, and reported
as equivalent, not run. Results go to `.mutate/` (git-ignored), one JSON line per mutant.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EQUIVALENT = Path(__file__).with_name("equivalent.toml")
RESULTS = ROOT / ".mutate"

# each module against its own tests, smallest and most important first: the fastest file first, as `-x` stops
# a killed mutant's run at its first failure
MODULES: dict[str, list[str]] = {
    "kvstore/record.py": ["tests/kvstore/test_record.py", "tests/property/test_record.py"],
    "kvstore/block.py": ["tests/kvstore/test_block.py", "tests/kvstore/test_image_identity.py"],
    "kvstore/codec.py": ["tests/kvstore/test_codec.py"],
    "kvstore/server/arriving.py": ["tests/kvstore/server/test_arriving.py"],
    "kvstore/server/recovery.py": ["tests/faults/test_recovery.py"],
    # these two have no test file of their own: the files that reach them (the client's gets; the prefill
    # engine's window tier, records and replay)
    "kvstore/client/assembly.py": ["tests/kvstore/client/test_client.py"],
    "engine/window/keeper.py": ["tests/engine/window/test_tier.py", "tests/engine/window/test_record.py",
                                "tests/engine/prefill/test_replay.py"],
}

# One mutant per kind of change and place, as mutmut does, rather than cosmic-ray's every operator into every
# other (ten per `+`): a comparison's boundary (`<` to `<=` and back), equality negated, arithmetic inverted,
# bits and shifts swapped for their partner, conditions negated, booleans flipped, constants changed, loops made
# to run zero times, `break`/`continue` swapped. What the rest add is mostly mutants the same tests kill.
OPERATORS = [
    "core/ReplaceComparisonOperator_Lt_LtE", "core/ReplaceComparisonOperator_LtE_Lt",
    "core/ReplaceComparisonOperator_Gt_GtE", "core/ReplaceComparisonOperator_GtE_Gt",
    "core/ReplaceComparisonOperator_Eq_NotEq", "core/ReplaceComparisonOperator_NotEq_Eq",
    "core/ReplaceComparisonOperator_Is_IsNot", "core/ReplaceComparisonOperator_IsNot_Is",
    "core/ReplaceBinaryOperator_Add_Sub", "core/ReplaceBinaryOperator_Sub_Add",
    "core/ReplaceBinaryOperator_Mul_FloorDiv", "core/ReplaceBinaryOperator_FloorDiv_Mul",
    "core/ReplaceBinaryOperator_Div_Mul", "core/ReplaceBinaryOperator_Mod_FloorDiv",
    "core/ReplaceBinaryOperator_LShift_RShift", "core/ReplaceBinaryOperator_RShift_LShift",
    "core/ReplaceBinaryOperator_BitAnd_BitOr", "core/ReplaceBinaryOperator_BitOr_BitAnd",
    "core/ReplaceBinaryOperator_BitXor_BitOr",
    "core/ReplaceUnaryOperator_USub_UAdd", "core/ReplaceUnaryOperator_Delete_Not",
    "core/AddNot", "core/ReplaceTrueWithFalse", "core/ReplaceFalseWithTrue",
    "core/ReplaceAndWithOr", "core/ReplaceOrWithAnd",
    "core/ReplaceBreakWithContinue", "core/ReplaceContinueWithBreak",
    "core/NumberReplacer", "core/ZeroIterationForLoop",
]


@dataclass
class Mutant:
    module: str
    operator: str
    occurrence: int
    line: int  # 1-based
    source: str  # the original line, stripped

    def label(self) -> str:
        return f"{self.module}:{self.line} {self.operator.removeprefix('core/')}: {self.source}"


def annotations(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The (start, end) positions of every annotation in `source`. Under `from __future__ import annotations`
    (all of these modules) an annotation is never evaluated, so a mutant in one (`bytes | None` made
    `bytes & None`) is equivalent by construction: such mutants are not made."""
    assert "from __future__ import annotations" in source, "the annotations of this module are evaluated"
    spans = []
    for node in ast.walk(ast.parse(source)):
        found = []
        if isinstance(node, ast.arg | ast.AnnAssign) and node.annotation is not None:
            found.append(node.annotation)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
            found.append(node.returns)
        spans += [((a.lineno, a.col_offset), (a.end_lineno or a.lineno, a.end_col_offset or 0)) for a in found]
    return spans


def mutants(module: str) -> list[Mutant]:
    """Every mutant of `module` that OPERATORS make, in the order of the operators and their occurrences, but
    those in annotations."""
    from cosmic_ray.ast import ast_nodes, get_ast_from_path
    from cosmic_ray.plugins import get_operator

    path = ROOT / module
    source = path.read_text()
    lines = source.splitlines()
    unevaluated = annotations(source)
    found = []
    for name in OPERATORS:
        operator = get_operator(name)()
        module_ast = get_ast_from_path(path)
        positions = [start for node in ast_nodes(module_ast) for start, _ in operator.mutation_positions(node)]
        for occurrence, (line, column) in enumerate(positions):
            # one mutant per operator and place: NumberReplacer offers n+1 and n-1, the first is enough
            if occurrence and positions[occurrence - 1] == (line, column):
                continue
            if any(start <= (line, column) < end for start, end in unevaluated):
                continue
            found.append(Mutant(module, name, occurrence, line, lines[line - 1].strip()))
    return found


def equivalents() -> list[dict[str, str]]:
    entries = tomllib.loads(EQUIVALENT.read_text()).get("equivalent", [])
    for entry in entries:
        missing = {"module", "operator", "line", "why"} - entry.keys()
        assert not missing, f"{EQUIVALENT.name}: an entry lacks {sorted(missing)}: {entry}"
    return entries


def mutated_line(mutant: Mutant) -> str:
    """The mutant's version of its line, stripped, as the report prints it after "now:"."""
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator

    code = mutate_code((ROOT / mutant.module).read_text(), get_operator(mutant.operator)(), mutant.occurrence)
    return code.splitlines()[mutant.line - 1].strip() if code else ""


def is_equivalent(mutant: Mutant, entries: list[dict[str, str]]) -> str | None:
    """The reason `mutant` is equivalent, if equivalent.toml lists it: same module, operator and source line
    (matched by its text, which survives edits elsewhere in the module where a line number would not), and,
    where the entry has `to`, the same mutated line (two mutants of one operator on one line differ there)."""
    for entry in entries:
        if (entry["module"], entry["operator"], entry["line"].strip()) == (mutant.module, mutant.operator,
                                                                          mutant.source):
            if "to" not in entry or entry["to"].strip() == mutated_line(mutant):
                return entry["why"]
    return None


def command(python: str, tests: list[str]) -> str:
    # -x: a mutant is killed at the first failure; no cache (a run's failures must not reorder the next), no
    # xdist (one process per mutant, two cores)
    return shlex.join([python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
                       "-p", "no:randomly", *tests])


def run(module: str, python: str, only_list: bool, survivors_only: bool = False) -> dict[str, object]:
    from cosmic_ray.mutating import mutate_and_test
    from cosmic_ray.work_item import MutationSpec, TestOutcome, WorkerOutcome

    tests = MODULES[module]
    path = ROOT / module
    original = path.read_bytes()
    entries = equivalents()
    todo = mutants(module)
    digest = hashlib.sha256(original).hexdigest()[:16]
    log_path = RESULTS / (module.replace("/", "_").removesuffix(".py") + ".jsonl")
    previous: dict[tuple[str, int], str] = {}
    if survivors_only:
        # the outcomes of the last full run, if it ran on this very source: only its survivors run again
        if log_path.exists():
            for line in log_path.read_text().splitlines():
                entry = json.loads(line)
                if entry.get("source") == digest:
                    previous[(entry["operator"], entry["occurrence"])] = entry["outcome"]
        if any((mutant.operator, mutant.occurrence) not in previous for mutant in todo):
            sys.exit(f"{module}: no complete earlier run of this source in {log_path}; run it whole first")
    print(f"== {module}: {len(todo)} mutants, tests: {' '.join(tests)}", flush=True)
    if only_list:
        for mutant in todo:
            why = is_equivalent(mutant, entries)
            print(f"  {mutant.label()}" + (f"   [equivalent: {why}]" if why else ""))
        return {}
    test_command = command(python, tests)
    began = time.monotonic()
    baseline = subprocess.run(shlex.split(test_command), cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    baseline_s = time.monotonic() - began
    if baseline.returncode != 0:
        sys.exit(f"{module}: its tests fail on the unmutated code; fix that first:\n{baseline.stdout[-3000:]}")
    # a mutant that makes its tests hang (a loop that never ends, a daemon that never answers) is killed by the
    # timeout: three times the unmutated run, and never under 20 s, as the machine is shared
    timeout = max(20.0, 3 * baseline_s)
    RESULTS.mkdir(exist_ok=True)
    log = log_path.open("w")
    killed, survived, equivalent, timeouts, incompetent = [], [], [], [], []
    try:
        for number, mutant in enumerate(todo, 1):
            why = is_equivalent(mutant, entries)
            earlier = previous.get((mutant.operator, mutant.occurrence))
            if why is None and earlier is not None and earlier != "survived":
                outcome = earlier
                if earlier.startswith("killed"):
                    killed.append(mutant)
                    if earlier == "killed (timeout)":
                        timeouts.append(mutant)
                elif earlier == "error":
                    incompetent.append(mutant)
            elif why is not None:
                equivalent.append((mutant, why))
                outcome = "equivalent"
            else:
                spec = MutationSpec(module_path=path, operator_name=mutant.operator, operator_args={},
                                    occurrence=mutant.occurrence, start_pos=(mutant.line, 0),
                                    end_pos=(mutant.line, 1))
                result = mutate_and_test([spec], test_command, timeout)
                if result.worker_outcome == WorkerOutcome.NO_TEST:
                    outcome = "no mutation"
                elif result.worker_outcome != WorkerOutcome.NORMAL:
                    incompetent.append(mutant)
                    outcome = "error"
                    print(result.output[-2000:], file=sys.stderr)
                elif result.test_outcome == TestOutcome.SURVIVED:
                    survived.append((mutant, result.diff))
                    outcome = "survived"
                elif result.output == "timeout":
                    timeouts.append(mutant)
                    killed.append(mutant)
                    outcome = "killed (timeout)"
                else:
                    killed.append(mutant)
                    outcome = "killed"
            if earlier is None or earlier == "survived" or why is not None:
                print(f"  [{number}/{len(todo)}] {outcome}: {mutant.label()}", flush=True)
            log.write(json.dumps({"mutant": mutant.label(), "operator": mutant.operator, "source": digest,
                                  "occurrence": mutant.occurrence, "outcome": outcome}) + "\n")
            log.flush()
    finally:
        log.close()
        if path.read_bytes() != original:  # cosmic-ray restores the file; this makes sure of it
            path.write_bytes(original)
            print(f"{module}: restored the unmutated file", file=sys.stderr)
    wall = time.monotonic() - began
    total = len(killed) + len(survived)
    print(f"== {module}: {len(killed)} killed / {total} run ({len(timeouts)} by timeout), {len(equivalent)} "
          f"equivalent, {len(survived)} surviving, {len(incompetent)} errors; {wall:.0f} s "
          f"(unmutated tests {baseline_s:.1f} s)")
    for mutant, why in equivalent:
        print(f"  equivalent: {mutant.label()}\n      why: {why}")
    for mutant, diff in survived:
        changed = [line for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
        print(f"  SURVIVED: {mutant.label()}\n      now: {changed[0][1:].strip() if changed else '?'}")
    return {"module": module, "mutants": len(todo), "killed": len(killed), "equivalent": len(equivalent),
            "surviving": len(survived), "errors": len(incompetent), "wall_s": round(wall)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"paths from the repository root (default: all of {list(MODULES)})")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs the tests")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--survivors", action="store_true",
                        help="run again only the mutants that survived the last whole run (after adding tests)")
    args = parser.parse_args()
    unknown = [module for module in args.modules if module not in MODULES]
    if unknown:
        sys.exit(f"not a module this runs: {unknown}; choose from {list(MODULES)}")
    os.chdir(ROOT)
    # stopped by a signal, the module is put back all the same (SystemExit runs the `finally`s)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped"))
    summaries = [run(module, args.python, args.list, args.survivors) for module in args.modules or MODULES]
    if not args.list:
        print("\nmodule                          mutants  killed  equivalent  surviving  wall")
        for s in summaries:
            print(f"{s['module']:<32}{s['mutants']:>7}{s['killed']:>8}{s['equivalent']:>12}{s['surviving']:>11}"
                  f"{s['wall_s']:>5} s")
        if any(s["surviving"] or s["errors"] for s in summaries):
            sys.exit(1)


if __name__ == "__main__":
    main()
