"""The pure parts of ``genpool_torch.capture`` (snapshot events -> trace rows, stream ids, call-site hashes,
CSV output, the expected events of a snapshot fixture) and the GPU-free logic of ``examples/bench_train.py``
and ``examples/train.py`` (arguments, budget skipping, results files, the table), on fake data: no torch,
no GPU, no genpool library. With torch and a CUDA device present, one more test records the snapshot
fixture for real.

Run: ``python3 -m unittest discover -s python/tests``.
"""

import gzip
import importlib.util
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
# GENPOOL_TEST_INSTALLED=1: the installed package, not the sources beside this folder.
INSTALLED = os.environ.get("GENPOOL_TEST_INSTALLED") == "1"
if not INSTALLED:
    sys.path.insert(0, str(HERE.parent))

from genpool_torch import capture as cap  # noqa: E402

FIXTURES = REPO / "crates" / "gen-trace" / "tests" / "fixtures"


def _load_example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", REPO / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load_example("bench_train")
train = _load_example("train")
ab = _load_example("ab_steps")


def parse_exits(test, parse, argv):
    """``parse(argv)`` must exit (argparse's error, its message kept off the test output); returns the
    ``SystemExit``."""
    with open(os.devnull, "w") as null:
        old, sys.stderr = sys.stderr, null
        try:
            with test.assertRaises(SystemExit) as cm:
                parse(argv)
        finally:
            sys.stderr = old
    return cm.exception


def ev(action, addr=0, size=0, stream=0, t=0, frames=None, **extra):
    e = {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": t,
         "frames": frames if frames is not None else [], "compile_context": "N/A", "user_metadata": ""}
    e.update(extra)
    return e


def frames(n, tag):
    return [{"filename": f"/src/{tag}.py", "line": i + 1, "name": f"f{i}"} for i in range(n)]


S1 = 0x55D4_1C2E_3F80  # stream handles as PyTorch reports them (pointers)
S2 = 0x55D4_1C2E_4A10


class SiteHashTest(unittest.TestCase):
    def test_matches_gen_trace(self):
        # gen-trace's site.rs test: the same two frames hash to PY_SITE there.
        fr = [{"filename": "model.py", "line": 42, "name": "forward"},
              {"filename": "train.py", "line": 7, "name": "<module>"}]
        self.assertEqual(cap.site_hash(fr), 190_794_870_479_121)

    def test_no_frames_is_unknown(self):
        self.assertEqual(cap.site_hash([]), 0)
        self.assertEqual(cap.site_hash(None), 0)

    def test_top_eight_frames_only_and_48_bits(self):
        a, b = frames(8, "x"), frames(8, "x") + frames(3, "other")
        self.assertEqual(cap.site_hash(a), cap.site_hash(b))
        self.assertNotEqual(cap.site_hash(a), cap.site_hash(frames(7, "x")))
        self.assertNotEqual(cap.site_hash(frames(2, "x")), cap.site_hash(frames(2, "y")))
        for n in range(1, 12):
            self.assertLess(cap.site_hash(frames(n, "z")), 1 << 48)

    def test_odd_fields_read_as_gen_trace_reads_them(self):
        base = [{"filename": "f.py", "line": 0, "name": "g"}]
        self.assertEqual(cap.site_hash([{"filename": "f.py", "name": "g"}]), cap.site_hash(base))
        self.assertEqual(cap.site_hash([{"filename": "f.py", "line": True, "name": "g"}]), cap.site_hash(base))
        self.assertEqual(cap.site_hash([{"filename": "f.py", "line": "12", "name": "g"}]), cap.site_hash(base))
        self.assertEqual(cap.site_hash([{"filename": "f.py", "line": 1 << 70, "name": "g"}]), cap.site_hash(base))
        self.assertEqual(cap.site_hash([{"filename": None, "line": 0, "name": "g"}]),
                         cap.site_hash([{"filename": "", "line": 0, "name": "g"}]))

    def test_malformed_frames_are_errors(self):
        with self.assertRaisesRegex(cap.CaptureError, "not a dict"):
            cap.site_hash(["frame"])
        with self.assertRaisesRegex(cap.CaptureError, "not a list"):
            cap.site_hash("frames")


class StreamTest(unittest.TestCase):
    def test_handles_are_kept(self):
        self.assertEqual(cap.stream_id({"stream": S1}), S1)
        self.assertEqual(cap.stream_id({"stream": 0}), 0)
        self.assertEqual(cap.stream_id({}), 0)
        self.assertEqual(cap.stream_id({"stream": None}), 0)

    def test_bad_handles_are_errors(self):
        for bad in (-1, "0x10", 1.5, 1 << 64):
            with self.assertRaisesRegex(cap.CaptureError, "stream"):
                cap.stream_id({"stream": bad})

    def test_names(self):
        names = cap.stream_names({"compute": 0, "prefetch": S1}, [S2, 0, S1, S1])
        self.assertEqual(names, {0: "compute", S1: "prefetch", S2: "unnamed"})
        self.assertEqual(list(names), [0, S1, S2], "sorted by handle")
        self.assertEqual(cap.stream_names({}, [0]), {0: "default"})
        self.assertEqual(cap.stream_names({"b": S1, "a": S1}, [S1]), {S1: "a+b"})


class ConvertTest(unittest.TestCase):
    def trace(self):
        B = 0x7F00_0000_0000
        return [
            ev("free_completed", B - 512, 512, t=1),                  # allocated before recording
            ev("segment_alloc", B, 2 << 20, t=2),
            ev("alloc", B, 1024, 0, 3, frames(2, "a")),
            ev("alloc", B + 1024, 512, S1, 4, []),
            ev("free_requested", B, 1024, 0, 5),
            ev("free_completed", B, 1024, 0, 6),
            ev("alloc", B, 2048, S2, 7, frames(3, "b")),              # address reused, other stream
            ev("oom", 0, 1 << 40, 0, 8),
            ev("free_completed", B + 1024, 512, S1, 9),
            ev("segment_free", B, 2 << 20, t=10),
        ]

    def test_rows_and_figures(self):
        B = 0x7F00_0000_0000
        c = cap.convert(self.trace())
        site_a, site_b = cap.site_hash(frames(2, "a")), cap.site_hash(frames(3, "b"))
        self.assertEqual(c.rows, [
            (3, "a", B, 1024, 0, site_a),
            (4, "a", B + 1024, 512, S1, 0),
            (6, "f", B, 1024, 0, 0),
            (7, "a", B, 2048, S2, site_b),
            (9, "f", B + 1024, 512, S1, 0),
        ])
        self.assertEqual((c.allocs, c.frees, c.skipped_frees), (3, 2, 1))
        self.assertEqual(c.peak_live, 2048 + 512)
        self.assertEqual((c.live_at_end, c.live_bytes_at_end, c.sites), (1, 2048, 2))
        self.assertEqual(c.actions["free_completed"], 3)
        self.assertEqual(c.actions["segment_alloc"], 1)
        s = c.summary({"compute": 0, "prefetch": S1})
        self.assertEqual(s["trace_events"], 5)
        self.assertEqual([(x["stream"], x["role"], x["allocs"], x["frees"], x["alloc_bytes"])
                          for x in s["streams"]],
                         [(0, "compute", 1, 1, 1024), (S1, "prefetch", 1, 1, 512), (S2, "unnamed", 1, 0, 2048)])
        json.dumps(s)  # JSON-ready

    def test_empty_trace(self):
        c = cap.convert([])
        self.assertEqual((c.rows, c.peak_live, c.summary()["streams"]), ([], 0, []))

    def test_bad_events_name_their_index(self):
        B = 0x1000
        cases = [
            ([ev("alloc", B, 0)], "event 0: allocation of size 0"),
            ([ev("alloc", B, 512), ev("alloc", B, 512)], "event 1: allocation at 0x1000, which is already live"),
            ([ev("alloc", B, 512), ev("free_completed", B, 1024)], "event 1: free of 0x1000 with size 1024"),
            ([ev("alloc", B, 512), "x"], "event 1: not a dict"),
            ([{"addr": B}], "event 0: no `action`"),
            ([{"action": "alloc", "size": 512}], "event 0: no `addr`"),
            ([ev("alloc", "0x10", 512)], "event 0: `addr` is not a non-negative integer"),
            ([ev("alloc", B, 512, t=-5)], "event 0: `time_us`"),
            ([ev("alloc", B, 512, stream=-1)], "event 0: `stream`"),
            ([ev("alloc", B, 512, frames=[1])], "event 0: a frame is not a dict"),
        ]
        for events, msg in cases:
            with self.subTest(msg=msg), self.assertRaises(cap.CaptureError) as cm:
                cap.convert(events)
            self.assertIn(msg, str(cm.exception))

    def test_csv_round_trip(self):
        c = cap.convert(self.trace())
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "t.csv.gz"
            cap.write_csv(path, c.rows)
            self.assertEqual(os.listdir(d), ["t.csv.gz"], "no temporary file left")
            text = gzip.decompress(path.read_bytes()).decode()
        lines = text.splitlines()
        self.assertEqual(lines[0], "t_us,action,addr,size,stream,site")
        self.assertTrue(text.endswith("\n"))
        back = [tuple(int(x) if i != 1 else x for i, x in enumerate(line.split(","))) for line in lines[1:]]
        self.assertEqual(back, c.rows)
        self.assertEqual(cap.csv_text([]), "t_us,action,addr,size,stream,site\n")


class ExpectedTracesTest(unittest.TestCase):
    def test_matches_gen_trace_fixture(self):
        # The fixture gen-trace's reader is tested against (made by make_snapshot.py): the capture tool's
        # conversion must read the same events from it.
        with open(FIXTURES / "snapshot_small.pickle", "rb") as f:
            snap = pickle.load(f)
        expected = json.loads((FIXTURES / "snapshot_small.expected.json").read_text())
        self.assertEqual(cap.expected_traces(snap, "snapshot_small"), expected)

    def test_naming_and_empty_devices(self):
        one = {"device_traces": [[ev("alloc", 4096, 512)]]}
        self.assertEqual([t["name"] for t in cap.expected_traces(one, "s")], ["s"])
        self.assertEqual([t["name"] for t in cap.expected_traces({"device_traces": [[]]}, "s")], ["s"])
        two = {"device_traces": [[], [ev("alloc", 4096, 512)]]}
        self.assertEqual([t["name"] for t in cap.expected_traces(two, "s")], ["s:dev1"])

    def test_not_a_snapshot(self):
        for bad, msg in (([], "no `device_traces`"), ({"device_traces": [7]}, "device_traces\\[0\\]"),
                         ({"device_traces": [[ev("alloc", 1, 0)]]}, "device 0: event 0")):
            with self.subTest(bad=bad), self.assertRaisesRegex(cap.CaptureError, msg):
                cap.expected_traces(bad, "s")

    def test_trace_name_as_gen_trace(self):
        self.assertEqual(cap.trace_name("a/snapshot_torch.pickle"), "snapshot_torch")
        self.assertEqual(cap.trace_name("x.pickle.gz"), "x")
        self.assertEqual(cap.trace_name("x.csv.gz"), "x")
        self.assertEqual(cap.trace_name(".pkl"), ".pkl")


class CaptureArgsTest(unittest.TestCase):
    def parse_fails(self, argv):
        self.assertEqual(parse_exits(self, cap.parse_args, argv).code, 2)

    def test_workloads(self):
        a = cap.parse_args(["out", "gpt2_prefetch", "--steps", "3", "bert_serve_4streams"])
        self.assertEqual((a.outdir, a.workloads, a.steps), ("out", ["gpt2_prefetch", "bert_serve_4streams"], 3))
        self.assertEqual(cap.parse_args(["out", "all"]).workloads, list(cap.WORKLOADS))
        self.assertEqual(set(cap.WORKLOADS), {"gpt2_prefetch", "resnet_copy_overlap", "bert_serve_4streams"})
        self.assertEqual(cap.parse_args(["--snapshot-pickle", "x.pickle"]).snapshot_pickle, Path("x.pickle"))

    def test_bad_command_lines(self):
        for argv in ([], ["out"], ["out", "nope"], ["out", "all", "--steps", "0"],
                     ["--snapshot-pickle", "x", "out", "all"], ["out", "all", "--max-entries", "0"]):
            with self.subTest(argv=argv):
                self.parse_fails(argv)

    def test_child_process(self):
        a = cap.parse_args(["out", "gpt2_prefetch", "--steps", "4"])
        cmd = cap.child_command(a, "gpt2_prefetch")
        self.assertEqual(cmd[1:], ["-m", "genpool_torch.capture", "out", "gpt2_prefetch", "--child",
                                   "--max-entries", "3000000", "--steps", "4"])
        child = cap.parse_args(cmd[3:])
        self.assertTrue(child.child)
        self.assertEqual(child.workloads, ["gpt2_prefetch"])
        env = cap.child_env({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", "PYTHONPATH": "/x"})
        self.assertNotIn("PYTORCH_CUDA_ALLOC_CONF", env)
        self.assertEqual(env["PYTHONPATH"].split(os.pathsep), [str(Path(cap.__file__).resolve().parent.parent), "/x"])

    def test_module_runs_without_torch(self):
        env = cap.child_env(os.environ)
        r = subprocess.run([sys.executable, "-m", "genpool_torch.capture", "--help"], env=env,
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("gpt2_prefetch", r.stdout)


def _cuda():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


class WithoutTorchTest(unittest.TestCase):
    """``python -m genpool_torch.capture`` where PyTorch cannot be imported (``sys.modules["torch"] =
    None`` hides it even where it is installed): one line on stderr, exit status 2, no traceback."""

    def test_capture_without_torch_is_one_line_and_status_2(self):
        hide = ("import runpy, sys; sys.modules['torch'] = None; "
                "runpy.run_module('genpool_torch.capture', run_name='__main__', alter_sys=True)")
        for args in (["gpt2_prefetch"], ["--snapshot-pickle", "x.pickle"]):
            with tempfile.TemporaryDirectory() as d:
                env = dict(os.environ) if INSTALLED else dict(os.environ, PYTHONPATH=str(HERE.parent))
                r = subprocess.run([sys.executable, "-c", hide, *([d] if args[0][0] != "-" else []), *args],
                                   env=env, capture_output=True, text=True, timeout=60, cwd=d)
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertNotIn("Traceback", r.stderr)
                lines = r.stderr.strip().splitlines()
                self.assertEqual(len(lines), 1, r.stderr)
                self.assertIn("PyTorch is not installed", lines[0])
                self.assertIn("pip install torch", lines[0])
                self.assertEqual(os.listdir(d), [], "nothing written")


@unittest.skipUnless(_cuda(), "needs torch with a CUDA device")
class SnapshotOnGpuTest(unittest.TestCase):
    def test_snapshot_fixture(self):
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "snapshot_torch.pickle"
            r = subprocess.run([sys.executable, "-m", "genpool_torch.capture", "--snapshot-pickle", str(path)],
                               env=cap.child_env(os.environ), capture_output=True, text=True, timeout=300)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertLess(path.stat().st_size, cap.SNAPSHOT_LIMIT)
            expected = json.loads((Path(d) / "snapshot_torch.expected.json").read_text())
        evs = expected[0]["events"]
        self.assertGreaterEqual(len({e["stream"] for e in evs}), 2, "two streams")
        self.assertTrue(any(e["kind"] == "free" for e in evs))
        self.assertTrue(any(e["site"] for e in evs if e["kind"] == "alloc"))


# ------------------------------------------------------------------------------------------------
# examples/bench_train.py and examples/train.py


def fake_result(model, alloc, step_ms=100.0, peak=1 << 30):
    return {"model": model, "allocator": alloc, "median_step_ms": step_ms, "mean_step_ms": step_ms + 1,
            "peak_bytes": peak, "peak_method": "nvml-process", "allocator_reserved_peak": 3 << 29,
            "allocator_allocated_peak": 1 << 29, "losses": [1.0, 0.5]}


class FakeRunner:
    """Stands in for bench_train.run: fixed seconds per run on a fake clock, canned results."""

    def __init__(self, run_s=20.0, check_s=40.0, fail=(), differ=()):
        self.now = 0.0
        self.run_s, self.check_s = run_s, check_s
        self.fail, self.differ = set(fail), set(differ)
        self.calls = []

    def clock(self):
        return self.now

    def __call__(self, cmd, timeout):
        self.calls.append((cmd, timeout))
        model = cmd[cmd.index("--model") + 1]
        if "--check-losses" in cmd:
            self.now += self.check_s
            return {"check": "losses", "model": model, "ok": model not in self.differ}, None, "check log"
        alloc = cmd[cmd.index("--allocator") + 1]
        self.now += self.run_s
        if (model, alloc) in self.fail:
            return None, "Traceback ...\nRuntimeError: CUDA error | bad", "trace"
        return fake_result(model, alloc, 100.0 if alloc == "native" else 105.0), None, "run log"


class BenchTrainTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.out = Path(self.tmp.name)

    def tearDown(self):
        self.tmp.cleanup()

    def bench(self, argv, runner):
        with open(os.devnull, "w") as null:
            old, sys.stdout = sys.stdout, null
            try:
                return bench.main(argv + ["--out", str(self.out)], runner=runner, clock=runner.clock)
            finally:
                sys.stdout = old

    def records(self):
        return bench.read_records(self.out / bench.RESULTS)

    def test_args(self):
        a = bench.parse_args([])
        self.assertEqual((a.models, a.allocators), (list(bench.MODELS), list(bench.ALLOCATORS)))
        self.assertEqual((a.steps, a.warmup, a.budget_s, a.check_models), (20, 3, 0, ["gpt2"]))
        a = bench.parse_args(["--models", "gpt2, resnet50", "--allocators", "native,genpool"])
        self.assertEqual((a.models, a.allocators), (["gpt2", "resnet50"], ["native", "genpool"]))
        cmd = bench.train_cmd(bench.parse_args(["--genpool-conf", "x:1"]), "gpt2", "genpool")
        self.assertEqual(cmd[2:], ["--model", "gpt2", "--allocator", "genpool", "--steps", "23", "--warmup", "3",
                                   "--json", "--quiet", "--genpool-conf", "x:1"])
        # train.py accepts what bench_train.py passes it
        t = train.parse_args(cmd[2:])
        self.assertEqual((t.model, t.allocator, t.steps, t.warmup, t.genpool_conf), ("gpt2", "genpool", 23, 3, "x:1"))
        t = train.parse_args(bench.check_cmd(bench.parse_args([]), "gpt2")[2:])
        self.assertTrue(t.check_losses)
        self.assertEqual(t.check_steps, 20)

    def test_bad_args(self):
        for argv in (["--models", "gpt3"], ["--models", ""], ["--allocators", "rmm"], ["--steps", "0"],
                     ["--budget-s", "-1"], ["--check-models", "resnet50"], ["--timeout", "0"],
                     ["--repeats", "0"], ["--sample-ms", "-2"]):
            with self.subTest(argv=argv):
                parse_exits(self, bench.parse_args, argv)
        for argv in (["--model", "gpt3"], ["--steps", "0"], ["--warmup", "-1"], ["--sample-ms", "-1"]):
            with self.subTest(argv=argv):
                parse_exits(self, train.parse_args, argv)

    def test_all_runs_without_budget(self):
        r = FakeRunner()
        self.assertEqual(self.bench(["--check-losses"], r), 0)
        recs = self.records()
        runs = [x for x in recs if x["kind"] == "run"]
        self.assertEqual([(x["model"], x["allocator"]) for x in runs],
                         [(m, a) for m in bench.MODELS for a in bench.ALLOCATORS])
        self.assertTrue(all("losses" not in x and x["elapsed_s"] == 20.0 for x in runs))
        checks = [x for x in recs if x["kind"] == "check"]
        self.assertEqual([(x["model"], x["ok"]) for x in checks], [("gpt2", True)])
        self.assertEqual(recs.index(checks[0]), 4, "the gpt2 check runs right after the gpt2 rows")
        self.assertTrue(all(t == 300 for cmd, t in r.calls if "--allocator" in cmd))
        self.assertEqual([t for cmd, t in r.calls if "--check-losses" in cmd], [600])
        self.assertEqual(sorted(os.listdir(self.out / "logs"))[:2], ["gpt2-async.log", "gpt2-check.log"])
        self.assertEqual((self.out / "logs" / "gpt2-check.log").read_text(), "check log")
        table = (self.out / bench.TABLE).read_text()
        self.assertEqual(table, bench.format_table(recs))
        self.assertIn("| gpt2 | genpool | 105.00 | 1.050x | 106.00 | 1024 | 1.000x | 1536 / 512 | equal |", table)

    def test_budget_skips_what_does_not_fit(self):
        # Default estimates: gpt2 25 s until a run is timed, then the longest gpt2 run (20 s).
        r = FakeRunner(run_s=20.0, check_s=40.0)
        self.assertEqual(self.bench(["--models", "gpt2,resnet50", "--check-losses", "--budget-s", "150"], r), 2)
        recs = self.records()
        got = [(x["kind"], x["model"], x.get("allocator"), "skipped" in x) for x in recs]
        # gpt2: 4 runs of 20 s (80 s used); its check, estimated at 2.5 x 20 = 50 s, fits in 70 s (120 s
        # used); resnet50's first run (default estimate 25 s) fits in 30 s; the next ones, estimated at the
        # 20 s just measured, do not fit in the 10 s left.
        self.assertEqual(got, [
            ("run", "gpt2", "native", False), ("run", "gpt2", "expandable", False),
            ("run", "gpt2", "async", False), ("run", "gpt2", "genpool", False),
            ("check", "gpt2", None, False),
            ("run", "resnet50", "native", False), ("run", "resnet50", "expandable", True),
            ("run", "resnet50", "async", True), ("run", "resnet50", "genpool", True),
        ])
        self.assertEqual(recs[6]["skipped"], "budget: needs ~20 s, 10 s of 150 s left")
        # every run was given at most the time left
        self.assertEqual([round(t) for _, t in r.calls], [150, 130, 110, 90, 70, 30])
        table = (self.out / bench.TABLE).read_text()
        self.assertIn("| resnet50 | expandable | skipped (budget: needs ~20 s, 10 s of 150 s left) |", table)

    def test_tight_budget_runs_nothing(self):
        r = FakeRunner()
        self.assertEqual(self.bench(["--models", "gpt2", "--allocators", "native", "--budget-s", "5"], r), 2)
        self.assertEqual(r.calls, [])
        self.assertEqual(len(self.records()), 1)

    def test_errors_and_mismatches_fail(self):
        r = FakeRunner(fail={("gpt2", "async")}, differ={"gpt2"})
        self.assertEqual(self.bench(["--models", "gpt2", "--check-losses"], r), 1)
        table = (self.out / bench.TABLE).read_text()
        self.assertIn("| gpt2 | async | error: RuntimeError: CUDA error / bad |||||| |", table)
        self.assertIn("| DIFFER |", table)
        for line in table.splitlines()[:6]:
            self.assertEqual(line.count("|"), 10, line)

    def test_table_from_results_file(self):
        r = FakeRunner()
        self.bench(["--models", "resnet50", "--allocators", "native,genpool"], r)
        with open(os.devnull, "w") as null:
            old, sys.stdout = sys.stdout, null
            try:
                self.assertEqual(bench.main(["--table", str(self.out / bench.RESULTS)]), 0)
            finally:
                sys.stdout = old
        # a results file cut short (e.g. by a time limit) still gives a table
        path = self.out / bench.RESULTS
        path.write_text(path.read_text() + '{"kind": "run", "model": "gpt2", "allo')
        table = bench.format_table(bench.read_records(path))
        self.assertIn("| resnet50 | genpool | 105.00 | 1.050x |", table)
        self.assertIn("Peak memory sampled by: nvml-process.", table)

    def test_repeats_interleave_and_summarise(self):
        r = FakeRunner()
        argv = ["--models", "resnet50", "--allocators", "native,genpool", "--repeats", "3", "--sample-ms", "0",
                "--genpool-timing"]
        self.assertEqual(self.bench(argv, r), 0)
        order = [(c[c.index("--allocator") + 1], c[c.index("--sample-ms") + 1], "--genpool-timing" in c)
                 for c, _ in r.calls]
        # repeat 0 in order, repeat 1 reversed, repeat 2 in order; timing only for genpool
        self.assertEqual(order, [("native", "0", False), ("genpool", "0", True), ("genpool", "0", True),
                                 ("native", "0", False), ("native", "0", False), ("genpool", "0", True)])
        recs = self.records()
        self.assertEqual([x["repeat"] for x in recs], [0, 0, 1, 1, 2, 2])
        self.assertEqual(sorted(os.listdir(self.out / "logs"))[:2], ["resnet50-genpool-0.log", "resnet50-genpool-1.log"])
        # train.py accepts what bench_train.py passes it
        t = train.parse_args(r.calls[1][0][2:])
        self.assertEqual((t.sample_ms, t.genpool_timing), (0.0, True))
        # medians over the runs; one repeat's genpool run made slower: the median ignores it, the
        # per-repeat ratios show it
        recs[5]["median_step_ms"] = 300.0
        recs[3]["median_host_ms"], recs[2]["median_host_ms"] = 10.0, 12.0
        table = bench.format_table(recs)
        self.assertIn("| resnet50 | genpool | 105.00 | 1.050x |", table)
        self.assertIn("| resnet50 | genpool | 3 | 1.050, 1.050, 3.000 | 12.00 | 1.200x |", table)

    def test_timed_window_deltas(self):
        after = {"pages": {"steals": 10, "page_size": 4, "note": "x"}, "host_timing": {"malloc": {"ns": 50}},
                 "flag": True}
        before = {"pages": {"steals": 3, "page_size": 4}, "host_timing": None}
        self.assertEqual(train._delta(after, before),
                         {"pages": {"steals": 7, "page_size": 0}, "host_timing": {"malloc": {"ns": 50}}})

    def test_one_run_each_has_no_repeat_table(self):
        r = FakeRunner()
        self.bench(["--models", "gpt2", "--allocators", "native,genpool"], r)
        table = (self.out / bench.TABLE).read_text()
        self.assertNotIn("per repeat", table)
        self.assertTrue(all("repeat" not in x for x in self.records()))
        self.assertNotIn("--sample-ms", r.calls[0][0])

    def test_run_kills_the_process_group_on_timeout(self):
        # A parent that starts a child and waits: both must be gone when run() returns.
        pidfile = self.out / "grandchild.pid"
        prog = ("import subprocess, sys, time; "
                "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)")
        t = time.monotonic()
        res, err, _ = bench.run([sys.executable, "-c", prog], 1.5)
        self.assertLess(time.monotonic() - t, 30)
        self.assertIsNone(res)
        self.assertIn("timed out", err)
        pid = int(pidfile.read_text())
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            self.fail("the grandchild survived")

    def test_run_reads_the_last_json_line(self):
        prog = "print('noise'); print('{\"a\": 1}'); print('{\"a\": 2}')"
        self.assertEqual(bench.run([sys.executable, "-c", prog], 30)[:2], ({"a": 2}, None))
        res, err, _ = bench.run([sys.executable, "-c", "import sys; sys.exit('bad thing')"], 30)
        self.assertIsNone(res)
        self.assertIn("bad thing", err)


# examples/ab_steps.py

FAKE_CHILD = r"""
import json, sys
scale, fail_at = float(sys.argv[1]), int(sys.argv[2])
print("noise before ready", flush=True)
print("ready", flush=True)
i = 0
for line in sys.stdin:
    if line.strip() != "go":
        break
    if i == fail_at:
        sys.exit(3)
    # step times drift over the run (as a machine's clocks do); the drift is the same for both sides
    print(f"step {i} {scale * (10.0 + i):.4f}", flush=True)
    i += 1
print(json.dumps({"steps": i, "step_ms": [], "losses": [1.0] * i, "allocator": "x"}), flush=True)
"""


class AbStepsTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self.tmp.name)
        self.child = self.dir / "child.py"
        self.child.write_text(FAKE_CHILD)

    def tearDown(self):
        self.tmp.cleanup()

    def cmd(self, scale, fail_at=-1):
        return [sys.executable, str(self.child), str(scale), str(fail_at)]

    def test_pairs_alternate_and_ratios_cancel_drift(self):
        rec = ab.run_pair(self.cmd(1.0), self.cmd(1.02), steps=30, warmup=5, logs=self.dir / "logs",
                          name="m", timeout=60)
        self.assertNotIn("error", rec)
        self.assertEqual(len(rec["a_ms"]), 35)
        self.assertEqual(rec["steps"], 30)
        # every step of B is 1.02 x A's same step, whatever the drift
        self.assertAlmostEqual(rec["median_ratio"], 1.02, places=4)
        self.assertAlmostEqual(rec["total_ratio"], 1.02, places=4)
        lo, hi = rec["ci95"]
        self.assertTrue(lo <= 1.02 <= hi)
        self.assertEqual(rec["b_result"]["steps"], 35)
        self.assertEqual(rec["a_losses"], [1.0] * 5)

    def test_a_child_that_dies_is_an_error_not_a_hang(self):
        rec = ab.run_pair(self.cmd(1.0), self.cmd(1.0, fail_at=3), steps=10, warmup=0, logs=self.dir / "logs",
                          name="m", timeout=60)
        self.assertIn("process ended", rec["error"])
        self.assertEqual(len(rec["b_ms"]), 3)

    def test_summary_and_table(self):
        s = ab.summarise([10, 10, 20, 40], [99, 11, 22, 40], warmup=1)
        self.assertEqual(s["steps"], 3)
        self.assertAlmostEqual(s["median_ratio"], 1.1)
        self.assertAlmostEqual(s["total_ratio"], 73 / 70)
        recs = [dict(s, model="resnet50", a="native", b="genpool"),
                {"model": "gpt2", "a": "native", "b": "genpool", "error": "boom"}]
        t = ab.table(recs)
        self.assertIn("| resnet50 | native | genpool | 3 | 20.00 / 22.00 | 1.1000 | 1.0000–1.1000 | 1.0429 "
                      "| B second only |", t)
        self.assertIn("| gpt2 | native | genpool | error: boom |", t)

    def test_both_orders_cancel_a_position_effect(self):
        # B is 1.02 x A; whichever process started second runs 0.94 x as long, step by step, with drift.
        n, pos = 40, 0.94
        base = [10.0 + 0.1 * i for i in range(n)]
        ab_run = {"a_ms": base, "b_ms": [1.02 * pos * t for t in base]}  # A first, B second
        ba_run = {"a_ms": [1.02 * t for t in base], "b_ms": [pos * t for t in base]}  # B first, A second
        r = ab.combine_orders(ab_run, ba_run, warmup=5)
        self.assertEqual(r["steps"], 2 * (n - 5))
        self.assertAlmostEqual(r["median_ratio"], 1.02, places=6)
        self.assertAlmostEqual(r["ratio_b_second"], 1.02 * pos, places=6)
        self.assertAlmostEqual(r["ratio_b_first"], 1.02 / pos, places=6)
        self.assertAlmostEqual(r["position_factor"], pos, places=6)
        lo, hi = r["ci95"]
        self.assertTrue(lo <= 1.02 <= hi)
        self.assertIn("| 0.9588 / 1.0851 |", ab.table([dict(r, model="resnet50", a="native", b="genpool")]))
        self.assertEqual(ab.combine_orders(ab_run, {"a_ms": [], "b_ms": []}, warmup=0), {"steps": 0})

    def test_measure_runs_both_orders(self):
        child = self.child

        class Args:
            a, b, steps, warmup, timeout, orders = "native", "genpool", 6, 1, 60, "both"
            out = self.dir

        scales = {"native": 1.0, "genpool": 1.05}
        orig = ab.child_cmd
        ab.child_cmd = lambda args, model, allocator: [sys.executable, str(child), str(scales[allocator]), "-1"]
        try:
            r = ab.measure(Args, "m")
            Args.orders = "ab"
            one = ab.measure(Args, "m")
        finally:
            ab.child_cmd = orig
        self.assertNotIn("error", r)
        self.assertAlmostEqual(r["median_ratio"], 1.05, places=4)
        self.assertEqual((len(r["ab"]["a_ms"]), len(r["ba"]["a_ms"])), (7, 7))
        self.assertTrue((self.dir / "logs" / "m-ba-a.log").is_file())
        self.assertNotIn("ba", one)
        self.assertAlmostEqual(one["median_ratio"], 1.05, places=4)

    def test_args_and_child_command(self):
        a = ab.parse_args(["--models", "gpt2,resnet50", "--steps", "7", "--genpool-conf", "k:1"])
        self.assertEqual(a.models, ["gpt2", "resnet50"])
        cmd = ab.child_cmd(a, "gpt2", "genpool")
        t = train.parse_args(cmd[2:])  # train.py accepts what ab_steps.py passes it
        self.assertTrue(t.lockstep)
        self.assertEqual((t.steps, t.sample_ms, t.genpool_conf), (27, 0.0, "k:1"))
        self.assertNotIn("--genpool-conf", ab.child_cmd(a, "gpt2", "native"))
        self.assertNotIn("--genpool-timing", cmd)
        timed = ab.parse_args(["--a", "floor", "--genpool-timing"])
        self.assertIn("--genpool-timing", ab.child_cmd(timed, "resnet50", "genpool"))
        self.assertNotIn("--genpool-timing", ab.child_cmd(timed, "resnet50", "floor"))
        self.assertEqual(train.parse_args(ab.child_cmd(timed, "resnet50", "floor")[2:]).allocator, "floor")
        for argv in (["--models", "gpt3"], ["--steps", "0"], ["--a", "genpool", "--b", "genpool"]):
            with self.subTest(argv=argv):
                parse_exits(self, ab.parse_args, argv)


if __name__ == "__main__":
    unittest.main()
