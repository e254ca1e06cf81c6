"""Host time of building a step's ``SamplingBatch`` with penalties: repetition penalty
alone against repetition penalty plus DRY (decision 0045), for batches of random token
histories, and DRY's own ``dry_penalties`` per row on real code tokens (the bundled
tokenizer on this interpreter's stdlib). CPU only; prints a table.

    PYTHONPATH=. python benchmarks/sampling_batch.py --rows 1,64 --lengths 500,2000
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from kvserve import SamplingParams
from kvserve.assets import DEFAULT_MODEL, MODELS_DIR
from kvserve.sampling.dry import DrySettings, dry_penalties
from kvserve.sampling.sampler import SamplingBatch, SamplingRows

REPETITION = {"temperature": 0.0, "repetition_penalty": 1.1}
DRY = {"dry_multiplier": 0.8, "dry_allowed_length": 8, "dry_sequence_breakers": []}


def mean_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1e3 * (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,64", help="batch sizes, comma-separated")
    p.add_argument("--lengths", default="500,2000", help="tokens per history (prompt + output)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    print("| rows | tokens each | repetition penalty, ms | + DRY 0.8 / 8, ms |")
    print("|---:|---:|---:|---:|")
    for num_rows in map(int, args.rows.split(",")):
        for length in map(int, args.lengths.split(",")):
            prompts = [rng.integers(0, 2000, length // 2).tolist() for _ in range(num_rows)]
            outputs = [rng.integers(0, 2000, length - length // 2).tolist()
                       for _ in range(num_rows)]
            times = []
            for extra in ({}, DRY):
                rows = SamplingRows.of([SamplingParams(**REPETITION, **extra)] * num_rows,
                                       args.vocab)
                times.append(mean_ms(lambda r=rows, p=prompts, o=outputs: SamplingBatch.from_rows(
                    r, p, o, [], {}, "cpu"), args.repeats))
            print(f"| {num_rows} | {length:,} | {times[0]:.2f} | {times[1]:.2f} |")
    tokenizer = Tokenizer.from_file(str(MODELS_DIR / DEFAULT_MODEL / "tokenizer.json"))
    sources = (Path(json.__file__).with_name("decoder.py"), Path(inspect.getfile(inspect)))
    code = tokenizer.encode("".join(path.read_text() for path in sources)).ids
    settings = DrySettings(0.8, 1.75, 8, -1, frozenset())
    print("\n| code tokens | dry_penalties, µs a row |\n|---:|---:|")
    for length in (256, 1024, 4096):
        history = code[:length]
        print(f"| {length:,} | "
              f"{1e3 * mean_ms(lambda h=history: dry_penalties(h, settings), 200):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
