"""Throughput of data/cached_fineweb10B.py against the tests' stand-in hub on 127.0.0.1 (a
measurement, not a test).

    python records/cpu-data-tools/fetch_bench.py                 # one 100M-token shard (~200 MB)
    python records/cpu-data-tools/fetch_bench.py --train 4 --workers 4

The shards are random tokens, made in memory before the clock starts (about 200 MB each); the
downloads go to --workdir (default: a folder under the system temp dir), never into the
repository. The number measures the client side (huggingface_hub, the script's sha256 check and
rename) over loopback, from the script's start to its exit; a real download is bounded by the
network instead.
"""

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "data" / "cached_fineweb10B.py"
# the tests' stand-in hub (in their test_fetch.py, with pytest), and the data tools it imports
sys.path[:0] = [str(REPO / "data"), str(REPO / "tests")]
spec = importlib.util.spec_from_file_location("test_fetch", REPO / "tests" / "test_fetch.py")
hub_stand_in = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hub_stand_in)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000_000, help="tokens per shard")
    parser.add_argument("--train", type=int, default=0, help="train shards besides the val shard")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "fetch_bench")
    args = parser.parse_args()
    out = args.workdir / "out"
    shutil.rmtree(out, ignore_errors=True)
    names = ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin"
                                          for i in range(1, args.train + 1)]
    hub = hub_stand_in.FakeHub()
    try:
        for seed, name in enumerate(names):
            hub.add(name, hub_stand_in.random_shard(args.tokens, seed))
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(args.workdir / "hf_home"),
                   HF_HUB_DISABLE_PROGRESS_BARS="1")
        command = [sys.executable, str(SCRIPT), str(args.train), "--workers", str(args.workers),
                   "--dir", str(out)]
        start = time.perf_counter()
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    finally:
        hub.stop()
    print(result.stdout + result.stderr, end="")
    total = sum((out / name).stat().st_size for name in names if (out / name).exists())
    print(f"{len(names)} file(s), {total / 1e6:.1f} MB in {seconds:.2f} s wall (process start to "
          f"exit): {total / 1e6 / seconds:.0f} MB/s")
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
