"""genpool_torch without PyTorch: the real shared library on genpool's simulated device, and install()'s
wiring against a stand-in ``torch`` module.

Run: ``cargo build -p genpool-torch && python3 -m unittest discover -s python/tests`` (the library is found
through ``GENPOOL_LIB`` or the repository's ``target/{release,debug}``).
"""

import ctypes
import os
import sys
import types
import unittest
from pathlib import Path
from unittest import mock

# Every pool this process creates is simulated; must be set before the library makes its first pool.
os.environ["GENPOOL_DEVICE"] = "sim"
# GENPOOL_TEST_INSTALLED=1 (.ci/run's fresh-venv step): test the installed package and the library it
# bundles, not the sources beside this folder.
INSTALLED = os.environ.get("GENPOOL_TEST_INSTALLED") == "1"
if not INSTALLED:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import genpool_torch as gt  # noqa: E402


def lib():
    return gt._load()


class LibraryTest(unittest.TestCase):
    @unittest.skipUnless(INSTALLED, "GENPOOL_TEST_INSTALLED=1 tests the installed package")
    def test_installed_package_bundles_its_library_and_header(self):
        pkg = Path(gt.__file__).resolve().parent
        self.assertNotIn("GENPOOL_LIB", os.environ)
        self.assertNotEqual(pkg, Path(__file__).resolve().parent.parent / "genpool_torch", "the installed copy")
        self.assertEqual(gt.library_path().parent, pkg, "the bundled library, not the repository's target/")
        self.assertTrue(gt.library_path().name.startswith("libgenpool_torch"))
        self.assertTrue((pkg / "include" / "genpool.h").is_file(), "the C header is bundled")

    def test_malloc_free_round_trip_updates_memory_stats(self):
        before = gt.memory_stats(1)
        p = lib().genpool_malloc(1000, 1, None)
        self.assertTrue(p, gt.last_error())
        self.assertEqual(p % 512, 0)
        s = gt.memory_stats(1)
        self.assertEqual(s["allocated_bytes.all.current"], before["allocated_bytes.all.current"] + 1024)
        self.assertEqual(s["allocation.all.allocated"], before["allocation.all.allocated"] + 1)
        self.assertGreaterEqual(s["allocated_bytes.all.peak"], 1024)
        self.assertGreaterEqual(s["reserved_bytes.all.current"], s["allocated_bytes.all.current"])
        self.assertEqual(gt.memory_allocated("cuda:1"), s["allocated_bytes.all.current"])
        lib().genpool_free(p, 1000, 1, None)
        s = gt.memory_stats(1)
        self.assertEqual(s["allocated_bytes.all.current"], before["allocated_bytes.all.current"])
        self.assertEqual(s["allocation.all.freed"], before["allocation.all.freed"] + 1)
        self.assertEqual(s["genpool.initialized"], True)
        self.assertIn("genpool.tier.slab.allocs", s)
        self.assertEqual(list(s), sorted(s), "sorted like torch.cuda.memory_stats()")

    def test_untouched_device_reads_zero(self):
        s = gt.raw_stats(7)
        self.assertFalse(s["initialized"])
        self.assertEqual(s["allocated_current"], 0)
        self.assertEqual(gt.trim(7), 0)

    def test_errors_surface_as_last_error(self):
        self.assertFalse(lib().genpool_malloc(1 << 60, 2, None))
        self.assertIn("invalid size", gt.last_error())
        self.assertFalse(lib().genpool_malloc(512, -1, None))
        self.assertIn("invalid device index", gt.last_error())
        with self.assertRaises(gt.GenpoolError):
            gt.raw_stats(10_000)
        # Size 0: NULL, not an error.
        self.assertFalse(lib().genpool_malloc(0, 2, None))

    def test_foreign_and_double_free_do_not_crash(self):
        p = lib().genpool_malloc(4096, 3, None)
        lib().genpool_free(p, 4096, 3, None)
        lib().genpool_free(p, 4096, 3, None)
        lib().genpool_free(0xDEAD000, 512, 3, None)
        self.assertEqual(gt.raw_stats(3)["num_invalid_frees"], 2)

    def test_empty_cache_and_trim_release_memory(self):
        blocks = [lib().genpool_malloc(16 << 20, 4, None) for _ in range(4)]
        for b in blocks:
            self.assertTrue(b)
            lib().genpool_free(b, 16 << 20, 4, None)
        held = gt.memory_reserved(4)
        self.assertGreater(held, 0)
        gt.empty_cache()
        self.assertLess(gt.memory_reserved(4), held)
        self.assertGreaterEqual(gt.max_memory_reserved(4), held)
        self.assertGreaterEqual(gt.max_memory_allocated(4), 16 << 20)

    def test_long_stats_are_read_whole(self):
        # The first read uses a 256-byte buffer; the JSON is longer, so _read must retry.
        s = gt.raw_stats(5)
        self.assertIn("tiers", s)
        self.assertGreater(len(str(s)), 256)

    def test_step_marks_an_iteration_as_context_and_decorator(self):
        with mock.patch.object(gt, "mark_iteration") as mark:
            with gt.step(device=2):
                pass
            mark.assert_called_once_with(2)

            @gt.step()
            def train():
                raise ValueError("boom")

            with self.assertRaises(ValueError):
                train()
            self.assertEqual(mark.call_count, 2, "marked even when the body raises")
        gt.mark_iteration(0)  # the real call on a live device does not fail
        lib().genpool_free(lib().genpool_malloc(512, 0, None), 512, 0, None)
        gt.mark_iteration(0)

    def test_device_index_forms(self):
        self.assertEqual(gt._device_index(3), 3)
        self.assertEqual(gt._device_index("cuda:2"), 2)
        self.assertEqual(gt._device_index(types.SimpleNamespace(type="cuda", index=5)), 5)
        with self.assertRaises(ValueError):
            gt._device_index("cpu")


class FakeAllocator:
    def __init__(self, path, alloc_name, free_name):
        self.args = (path, alloc_name, free_name)
        self.raw = mock.Mock()

    def allocator(self):
        return self.raw


def fake_torch(initialized=False, allocated=0, refuse=False):
    torch = types.ModuleType("torch")
    cuda = types.SimpleNamespace()
    cuda.is_initialized = lambda: initialized
    cuda.memory_allocated = lambda: allocated
    changed = []

    def change(alloc):
        if refuse:
            raise RuntimeError("Can't swap an already initialized allocator")
        changed.append(alloc)

    cuda.memory = types.SimpleNamespace(CUDAPluggableAllocator=FakeAllocator, change_current_allocator=change)
    torch.cuda = cuda
    return torch, changed


class InstallTest(unittest.TestCase):
    def tearDown(self):
        gt._allocator = None
        gt._mode = None

    def test_refuses_after_cuda_initialised(self):
        torch, changed = fake_torch(initialized=True, allocated=1 << 20)
        with mock.patch.dict(sys.modules, {"torch": torch}):
            with self.assertRaises(gt.GenpoolInstallError) as ctx:
                gt.install(backend="pluggable")
        self.assertIn("1048576 bytes", str(ctx.exception))
        self.assertIn("before any CUDA use", str(ctx.exception))
        self.assertEqual(changed, [])
        self.assertFalse(gt.is_installed())

    def test_wires_the_callbacks_pytorch_calls(self):
        torch, changed = fake_torch()
        with mock.patch.dict(sys.modules, {"torch": torch}):
            self.assertEqual(gt.install(oom="null", backend="pluggable"), "pluggable")
            alloc = gt._allocator
            self.assertEqual(gt.install(), "pluggable", "idempotent")
            self.assertIs(gt._allocator, alloc)
        self.assertEqual(changed, [alloc])
        self.assertEqual(alloc.args, (str(gt.library_path()), "genpool_malloc", "genpool_free"))
        addr = lambda name: ctypes.cast(getattr(lib(), name), ctypes.c_void_p).value  # noqa: E731
        alloc.raw.set_init_fn.assert_called_once_with(addr("genpool_init"))
        alloc.raw.set_reset_fn.assert_called_once_with(addr("genpool_reset"))
        alloc.raw.set_memory_fraction_fn.assert_called_once_with(addr("genpool_set_memory_fraction"))
        alloc.raw.set_record_stream_fn.assert_called_once_with(addr("genpool_record_stream"))
        self.assertTrue(gt.is_installed())

    def test_oom_raise_uses_the_wrapper(self):
        torch, changed = fake_torch()
        with mock.patch.dict(sys.modules, {"torch": torch}), \
                mock.patch.object(gt, "_oom_shim", return_value=Path("/x/shim.so")) as shim:
            gt.install(backend="pluggable")
            alloc = gt._allocator
        shim.assert_called_once_with(gt.library_path())
        self.assertEqual(alloc.args, ("/x/shim.so", "genpool_torch_malloc", "genpool_free"))
        self.assertEqual(changed, [alloc])

    def test_oom_wrapper_build_failure_is_a_clear_error(self):
        torch, changed = fake_torch()
        with mock.patch.dict(sys.modules, {"torch": torch}), \
                mock.patch.object(gt, "_oom_shim", side_effect=OSError("no c++")):
            with self.assertRaises(gt.GenpoolInstallError) as ctx:
                gt.install(backend="pluggable")
        self.assertIn("oom='null'", str(ctx.exception))
        self.assertEqual(changed, [])
        with self.assertRaises(ValueError):
            gt.install(oom="ignore")

    def test_refusal_by_pytorch_is_a_clear_error(self):
        torch, _ = fake_torch(refuse=True)
        with mock.patch.dict(sys.modules, {"torch": torch}):
            with self.assertRaises(gt.GenpoolInstallError) as ctx:
                gt.install(oom="null", backend="pluggable")
        self.assertIn("before any CUDA use", str(ctx.exception))

    def test_auto_falls_back_to_the_pluggable_hook_and_says_what_will_not_work(self):
        torch, changed = fake_torch()
        torch.__version__ = "2.4.0"  # older than the backend's interface
        with mock.patch.dict(sys.modules, {"torch": torch}):
            with self.assertWarns(RuntimeWarning) as w:
                self.assertEqual(gt.install(oom="null"), "pluggable")
        self.assertIn("torch.cuda.memory_stats()", str(w.warning))
        self.assertIn("2.4.0", str(w.warning))
        self.assertEqual(changed, [gt._allocator])
        self.assertEqual(gt.active_backend(), "pluggable")

    def test_allocator_backend_failure_is_a_clear_error(self):
        torch, changed = fake_torch()
        torch.__version__ = "2.4.0"
        with mock.patch.dict(sys.modules, {"torch": torch}):
            with self.assertRaises(gt.GenpoolInstallError) as ctx:
                gt.install(backend="allocator")
        self.assertIn("older than", str(ctx.exception))
        self.assertEqual(changed, [])
        with self.assertRaises(ValueError):
            gt.install(backend="bogus")

    def test_backend_is_built_with_the_system_compiler_against_torch(self):
        import genpool_torch.backend as b
        torch = types.ModuleType("torch")
        torch.__file__ = "/opt/torch/__init__.py"
        torch.__version__ = "2.11.0+cu130"
        torch._C = types.SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=True)
        with mock.patch.dict(os.environ, {"GENPOOL_CXX": "/usr/bin/c++", "CUDA_HOME": "/usr/local/cuda"}):
            cmd = b.compile_command(Path("/x/libgenpool_torch.so"), Path("/tmp/o.so"), torch)
            torch.__version__ = "2.15.0+cu132"
            newer = b.compile_command(Path("/x/libgenpool_torch.so"), Path("/tmp/o.so"), torch)
        self.assertIn("-std=c++17", cmd, "2.11 as validated on the GPU")
        self.assertIn("-std=c++20", newer, "2.15's headers need C++20")
        self.assertEqual(cmd[0], "/usr/bin/c++")
        self.assertIn("-D_GLIBCXX_USE_CXX11_ABI=1", cmd)
        self.assertIn("-I/opt/torch/include", cmd)
        self.assertIn("-I/usr/local/cuda/include", cmd)
        self.assertIn(str(b.SOURCE), cmd)
        self.assertIn("/x/libgenpool_torch.so", cmd)
        self.assertIn("-ltorch_cuda", cmd)
        self.assertTrue((b.header_dir() / "genpool.h").is_file())

    def test_compiles_are_checked_and_land_atomically(self):
        import tempfile
        import genpool_torch.backend as b
        with tempfile.TemporaryDirectory() as d:
            tmp, so = Path(d) / "x.tmp", Path(d) / "x.so"
            with self.assertRaises(b.BackendError) as ctx:
                b.compile_cached([sys.executable, "-c", "import sys; sys.exit(3)"], tmp, so, "the thing")
            self.assertIn("building the thing failed", str(ctx.exception))
            with self.assertRaises(gt.GenpoolError):
                b.compile_cached(["/nonexistent/c++"], tmp, so, "the thing", gt.GenpoolError)
            ok = b.compile_cached([sys.executable, "-c", f"open({str(tmp)!r}, 'w').write('lib')"], tmp, so, "x")
            self.assertEqual(ok, so)
            self.assertEqual(so.read_text(), "lib")
            self.assertFalse(tmp.exists(), "moved, not copied")

    def test_without_torch(self):
        with mock.patch.dict(sys.modules, {"torch": None}):
            with self.assertRaises(gt.GenpoolInstallError) as ctx:
                gt.install(backend="pluggable")
        msg = str(ctx.exception)
        self.assertNotIn("\n", msg, "one line")
        self.assertIn("needs PyTorch", msg)
        self.assertIn("pip install torch", msg)


if __name__ == "__main__":
    unittest.main()
