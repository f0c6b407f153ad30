"""Throughput of data/cached_fineweb10B.py against the local stand-in hub (not a test).

    python data/fetch_bench.py                      # one 100M-token shard (~200 MB), N=0 (val only)
    python data/fetch_bench.py --train 4 --workers 4

Files go to --workdir (default: a folder under the system temp dir), never into the repository.
The number measures the client side (huggingface_hub + the script's sha256 check and rename) over
loopback; a real download is bounded by the network instead.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the stand-in hub, beside this script (the tests use it too)
import fetch_hub

SCRIPT = Path(__file__).resolve().parent / "cached_fineweb10B.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokens", type=int, default=100_000_000, help="tokens per shard"
    )
    parser.add_argument(
        "--train", type=int, default=0, help="train shards besides the val shard"
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--workdir", type=Path, default=Path(tempfile.gettempdir()) / "fetch_bench"
    )
    args = parser.parse_args()

    served = args.workdir / "served"
    out = args.workdir / "out"
    served.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    names = ["fineweb_val_000000.bin"] + [
        f"fineweb_train_{i:06d}.bin" for i in range(1, args.train + 1)
    ]
    hub = fetch_hub.FakeHub()
    try:
        for seed, name in enumerate(names):
            path = served / name
            if not path.exists() or path.stat().st_size != 1024 + 2 * args.tokens:
                fetch_hub.write_random_shard(path, args.tokens, seed)
            hub.add(name, path)
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env.update(
            HF_ENDPOINT=hub.endpoint,
            HF_HOME=str(args.workdir / "hf_home"),
            HF_HUB_DISABLE_PROGRESS_BARS="1",
        )
        cmd = [
            sys.executable,
            str(SCRIPT),
            str(args.train),
            "--workers",
            str(args.workers),
            "--dir",
            str(out),
        ]
        start = time.perf_counter()
        result = subprocess.run(
            cmd, check=False, env=env, capture_output=True, text=True
        )
        seconds = time.perf_counter() - start
    finally:
        hub.stop()
    print(result.stdout + result.stderr, end="")
    total = sum((out / n).stat().st_size for n in names if (out / n).exists())
    print(
        f"{len(names)} file(s), {total / 1e6:.1f} MB in {seconds:.2f} s wall (process start to "
        f"exit): {total / 1e6 / seconds:.0f} MB/s"
    )
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
