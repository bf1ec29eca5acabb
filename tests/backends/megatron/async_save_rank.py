"""A rank of the --async-save tests (test_async_save.py); run through multirank.run_ranks or alone.

    python async_save_rank.py run    HF_DIR SAVE [--distributed SHARDING]  steps 1..4, async saves after 2 and 3
                                                                            (keep_checkpoints 1), written while
                                                                            steps 3 and 4 train
    python async_save_rank.py resume HF_DIR SAVE [--distributed SHARDING]  load the newest committed, step 4
    python async_save_rank.py crash  HF_DIR SAVE                           a committed sync save after step 1,
                                                                            then an async save after step 2 whose
                                                                            writer stalls: prints "writing" and
                                                                            waits to be killed
    python async_save_rank.py redo   HF_DIR SAVE                           resume the newest committed, step 2 and
                                                                            its async save again, committed

The background writer is slowed (`WRITE_DELAY_S` before each file, in the forked writer processes), so the
steps after a save really run while its files are written. One JSON line per step, as checkpoint_resume.py.
"""

import argparse
import functools
import json
import os
import time

from checkpoint_resume import report, setup, step
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from slime.backends.megatron.async_save import AsyncSaver
from slime.backends.megatron.bridge import close_megatron
from slime.backends.megatron.checkpoint import (
    iteration_dir,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from slime.storage.manifest import is_committed

WRITE_DELAY_S = 1.0


def slow_writer(delay: float) -> None:
    """Every file the background writers write waits `delay` seconds first (forked processes inherit it)."""
    write = FileSystemWriterAsync.write_preloaded_data

    @functools.wraps(write)
    def delayed(*args, **kwargs):
        time.sleep(delay)
        return write(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(delayed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["run", "resume", "crash", "redo"])
    parser.add_argument("hf_dir")
    parser.add_argument("save")
    parser.add_argument("--distributed", default=None, choices=["dp_reshardable", "fully_reshardable"])
    args = parser.parse_args()
    rank, world, bridge, models, optimizer, scheduler = setup(args.hf_dir, args.distributed)
    full = f"{args.save}/full"

    def save(k: int, saver: AsyncSaver | None, keep: int | None = None) -> None:
        save_checkpoint(models, full, k, optimizer=optimizer, scheduler=scheduler, extra_state={"cursor": k},
                        fully_reshardable=args.distributed == "fully_reshardable", keep=keep, saver=saver)

    if args.mode == "run":
        slow_writer(WRITE_DELAY_S)
        saver = AsyncSaver()
        for k in range(1, 5):
            loss = step(models, optimizer, scheduler, bridge, k, rank, world)
            saver.poll()
            if k in (2, 3):
                t0 = time.monotonic()
                save(k, saver, keep=1)
                stall = time.monotonic() - t0
                # returned before the files were written: not a checkpoint yet
                print(json.dumps({"rank": rank, "scheduled": k, "stall_s": stall,
                                  "committed_at_return": is_committed(iteration_dir(full, k))}), flush=True)
            report(models, optimizer, rank, k, "after step", loss=loss)
        saver.close()
        print(json.dumps({"rank": rank, "closed": True, "committed": saver.committed,
                          "left": sorted(os.listdir(full))}), flush=True)
    elif args.mode == "resume":
        path = latest_checkpoint(full)
        state = load_checkpoint(models, path, optimizer, scheduler)
        report(models, optimizer, rank, state.iteration, "after load", extra_state=state.extra_state, path=path)
        for k in range(state.iteration + 1, 5):
            loss = step(models, optimizer, scheduler, bridge, k, rank, world)
            report(models, optimizer, rank, k, "after step", loss=loss)
    elif args.mode == "crash":
        saver = AsyncSaver()
        step(models, optimizer, scheduler, bridge, 1, rank, world)
        save(1, None)  # committed, synchronously
        slow_writer(3600)
        step(models, optimizer, scheduler, bridge, 2, rank, world)
        save(2, saver)
        print(json.dumps({"rank": rank, "writing": 2}), flush=True)
        time.sleep(3600)  # killed here, the writer processes with it
    else:  # redo
        path = latest_checkpoint(full)
        state = load_checkpoint(models, path, optimizer, scheduler)
        report(models, optimizer, rank, state.iteration, "after load", path=path)
        saver = AsyncSaver()
        loss = step(models, optimizer, scheduler, bridge, 2, rank, world)
        save(2, saver)
        saver.close()
        report(models, optimizer, rank, 2, "after step", loss=loss, committed=saver.committed)


if __name__ == "__main__":
    main()
    close_megatron()
