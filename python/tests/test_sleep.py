"""genpool_torch.region / sleep / wake on genpool's simulated device (no PyTorch needed).

Run: ``cargo build -p genpool-torch && python3 -m unittest discover -s python/tests``. Devices 20-22 are
used only here; tags are process-wide, so each test uses its own names.
"""

import os
import sys
import threading
import unittest
from pathlib import Path

os.environ["GENPOOL_DEVICE"] = "sim"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import genpool_torch as gt  # noqa: E402
# The submodule (the package's `sleep` attribute is the function of the same name).
gs = sys.modules["genpool_torch.sleep"]

MIB = 1 << 20


def lib():
    return gt._load()


def tag_on(name, device):
    for t in gt.tags_info()["tags"]:
        if t["name"] == name:
            for d in t["devices"]:
                if d["device"] == device:
                    return t, d
            return t, None
    raise KeyError(name)


class SleepTest(unittest.TestCase):
    def test_region_tags_allocations_and_sleep_releases_them_keeping_pointers(self):
        dev = 20
        with gt.region("py-weights"):
            self.assertEqual(gt.current_tag(), "py-weights")
            w = [lib().genpool_malloc(8 * MIB, dev, None) for _ in range(3)]
            with gt.region("py-kv"):
                kv = lib().genpool_malloc(16 * MIB, dev, None)
            self.assertEqual(gt.current_tag(), "py-weights", "the outer tag comes back")
        self.assertEqual(gt.current_tag(), "default")
        plain = lib().genpool_malloc(MIB, dev, None)
        self.assertTrue(all(w) and kv and plain, gt.last_error())
        t, d = tag_on("py-weights", dev)
        self.assertEqual(d["allocated_current"], 24 * MIB)
        self.assertEqual(tag_on("py-kv", dev)[1]["allocated_current"], 16 * MIB)
        self.assertEqual(gt.raw_stats(dev)["allocated_current"], MIB, "untagged memory is the default tag")

        gt.sleep(["py-weights", "py-kv"], offload=True)
        self.assertEqual(set(gt.sleeping()) & {"py-weights", "py-kv"}, {"py-weights", "py-kv"})
        t, d = tag_on("py-weights", dev)
        self.assertTrue(t["asleep"] and d["asleep"])
        self.assertEqual(d["reserved_current"], 0, "reserved drops")
        self.assertEqual(d["allocated_current"], 24 * MIB, "allocated stays")
        self.assertGreaterEqual(d["sleeping_bytes"], 24 * MIB)
        self.assertEqual(d["offloaded_bytes"], d["sleeping_bytes"])
        # Allocating under a sleeping tag fails clearly; freeing works.
        with gt.region("py-kv"):
            self.assertFalse(lib().genpool_malloc(MIB, dev, None))
        self.assertIn("asleep", gt.last_error())
        lib().genpool_free(kv, 0, dev, None)
        self.assertEqual(tag_on("py-kv", dev)[1]["allocated_current"], 0)

        gt.wake(["py-kv", "py-weights"])
        self.assertFalse({"py-weights", "py-kv"} & set(gt.sleeping()))
        t, d = tag_on("py-weights", dev)
        self.assertGreaterEqual(d["reserved_current"], 24 * MIB)
        with gt.region("py-weights"):
            again = lib().genpool_malloc(MIB, dev, None)
        self.assertTrue(again, gt.last_error())
        before = gt.raw_stats(dev)["plugin_invalid_frees"]
        for p in w + [again, plain]:
            lib().genpool_free(p, 0, dev, None)
        self.assertEqual(gt.raw_stats(dev)["plugin_invalid_frees"], before, "frees find their tag's pool")
        self.assertEqual(tag_on("py-weights", dev)[1]["allocated_current"], 0)

    def test_bad_calls_raise_clear_errors(self):
        with gt.region("py-bad"):
            pass
        with self.assertRaises(gt.GenpoolSleepError) as e:
            gt.wake("py-bad")
        self.assertEqual(e.exception.code, gs.ERR_NOT_ASLEEP)
        self.assertIn("wake without sleep", str(e.exception))
        with self.assertRaises(gt.GenpoolSleepError) as e:
            gt.sleep(["py-bad", "py-never-made"])
        self.assertEqual(e.exception.code, gs.ERR_UNKNOWN_TAG)
        self.assertNotIn("py-bad", gt.sleeping(), "all or nothing")
        gt.sleep("py-bad")
        with self.assertRaises(gt.GenpoolSleepError) as e:
            gt.sleep("py-bad", offload=True)
        self.assertEqual(e.exception.code, gs.ERR_ASLEEP)
        self.assertIn("double sleep", str(e.exception))
        gt.wake("py-bad")
        for bad in ("", "a,b"):
            with self.assertRaises(ValueError):
                gt.sleep(bad)
            with self.assertRaises(ValueError):
                with gt.region(bad):
                    pass
        with self.assertRaises(ValueError):
            gt.wake([])
        with self.assertRaises(TypeError):
            gt.sleep([3])
        # A capture in progress (the flag the Python side passes when torch says it captures).
        self.assertEqual(lib().genpool_sleep(b"py-bad", gs.SLEEP_CAPTURING), gs.ERR_CAPTURING)
        self.assertIn("capture", gt.last_error())
        self.assertNotIn("py-bad", gt.sleeping())

    def test_tags_are_per_thread(self):
        dev = 21
        seen = {}

        def worker():
            seen["tag"] = gt.current_tag()
            seen["p"] = lib().genpool_malloc(4 * MIB, dev, None)

        with gt.region("py-thread"):
            mine = lib().genpool_malloc(4 * MIB, dev, None)
            th = threading.Thread(target=worker)
            th.start()
            th.join()
        self.assertEqual(seen["tag"], "default")
        self.assertEqual(tag_on("py-thread", dev)[1]["allocated_current"], 4 * MIB)
        self.assertEqual(gt.raw_stats(dev)["allocated_current"], 4 * MIB, "the other thread's is untagged")
        lib().genpool_free(mine, 0, dev, None)
        lib().genpool_free(seen["p"], 0, dev, None)

    def test_sleep_everything_including_the_default_tag(self):
        dev = 22
        p = lib().genpool_malloc(6 * MIB, dev, None)
        with gt.region("py-all"):
            q = lib().genpool_malloc(6 * MIB, dev, None)
        gt.sleep(offload=True)
        try:
            self.assertIn("default", gt.sleeping())
            self.assertIn("py-all", gt.sleeping())
            self.assertEqual(gt.raw_stats(dev)["reserved_current"], 0)
            self.assertTrue(gt.raw_stats(dev)["asleep"])
            self.assertFalse(lib().genpool_malloc(MIB, dev, None))
        finally:
            gt.wake()
        self.assertEqual(gt.sleeping(), [])
        self.assertFalse(gt.raw_stats(dev)["asleep"])
        lib().genpool_free(p, 0, dev, None)
        lib().genpool_free(q, 0, dev, None)


if __name__ == "__main__":
    unittest.main()
