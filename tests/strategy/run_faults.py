"""Trains ToyRecommender under PersiaStrategy with an injected fault (its own process: the DDP launcher re-runs it).

    python run_faults.py --out DIR [--devices 2] [--shards 2] [--steps 24] [--checkpoint-every 4]
        [--kill-shards S@STEP[,S@STEP...]]       rank 0 SIGKILLs embedded shard S after step STEP
        [--kill-rank R --kill-rank-at STEP]       rank R SIGKILLs itself after step STEP
        [--kill-in-save N]                        rank 0 SIGKILLs itself in the middle of its N-th PS save
        [--save-delay S]                          the shards pause S seconds per checkpoint file they write
        [--resume latest]                         resume from the newest checkpoint in DIR/ckpt

Every rank writes ``DIR/rank<R>.pt`` at the end: dense state, losses, rollbacks, shard events (rank 0), and
(rank 0) the tables fetched back from the shards. Prints ``STEP <n>`` lines as it trains.
"""
from __future__ import annotations

import argparse
import glob
import os
import signal
import sys
import threading
import time

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy import INIT, NUM_IDS, ToyRecommender, loader, make_batches  # noqa: E402

from lightning_persia import SGD, PersiaStrategy, PSSettings  # noqa: E402
from lightning_persia.remote_ps.config import DURABILITY  # noqa: E402
from lightning_persia.strategy.recovery import RecoveryConfig  # noqa: E402


class _Faults(L.Callback):
    def __init__(self, args) -> None:
        self.args = args
        self.losses: list[float] = []
        self.saves = 0
        self.done: set = set()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        step = trainer.global_step
        print(f"STEP {step} rank {trainer.global_rank}", flush=True)
        a = self.args
        for spec in filter(None, (a.kill_shards or "").split(",")):
            shard, at = (int(x) for x in spec.split("@"))
            if step == at and trainer.is_global_zero and (shard, at) not in self.done:
                self.done.add((shard, at))
                process = trainer.strategy._cluster.shards.processes[shard]
                print(f"KILL shard {shard} pid {process.pid} after step {step}", flush=True)
                os.kill(process.pid, signal.SIGKILL)
        if a.kill_rank is not None and step == a.kill_rank_at and trainer.global_rank == a.kill_rank:
            print(f"KILL rank {a.kill_rank} pid {os.getpid()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_save_checkpoint(self, trainer, module, checkpoint):
        self.saves += 1
        if self.args.kill_in_save and self.saves == self.args.kill_in_save and trainer.is_global_zero:
            pattern = os.path.join(self.args.out, "ckpt", "*.ps", "*", ".shard-*.tmp-*", "*.npy")

            def kill_when_writing() -> None:
                deadline = time.monotonic() + 60
                while not glob.glob(pattern) and time.monotonic() < deadline:
                    time.sleep(0.01)
                print(f"KILL rank 0 pid {os.getpid()} in the middle of save {self.saves}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

            threading.Thread(target=kill_when_writing, daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--kill-shards", help="S@STEP[,S@STEP...]")
    parser.add_argument("--kill-rank", type=int)
    parser.add_argument("--kill-rank-at", type=int, default=10)
    parser.add_argument("--kill-in-save", type=int, default=0)
    parser.add_argument("--save-delay", type=float, default=0.0)
    parser.add_argument("--resume")
    parser.add_argument("--durability", default="none", choices=DURABILITY,
                        help="the shards' PSConfig.durability (none: a killed shard costs a rollback)")
    args = parser.parse_args()

    ckpt_dir = os.path.join(args.out, "ckpt")
    resume = None
    if args.resume == "latest":
        found = sorted(glob.glob(os.path.join(ckpt_dir, "*.ckpt")), key=os.path.getmtime)
        resume = found[-1] if found else None
        print(f"RESUME {resume}", flush=True)
    ps_config = os.path.join(args.out, "ps.yaml")
    with open(ps_config, "w") as f:
        f.write(f"durability: {args.durability}\nfault_save_delay_s: {args.save_delay}\n")
    batches = make_batches(args.steps)
    torch.manual_seed(0)
    model = ToyRecommender(device="meta")
    strategy = PersiaStrategy(
        ps=PSSettings(num_local_shards=args.shards, timeout_s=20.0, config=ps_config), staleness=args.staleness,
        embedding_optimizer=SGD(lr=0.1), embedding_init=INIT, wire_dtype="fp32",
        recovery=RecoveryConfig(wait_for_shards_s=60, client_max_retries=2, client_backoff_s=0.05, client_max_backoff_s=0.2),
    )
    faults = _Faults(args)
    # Every rank trains every batch in order (no distributed sampler): a resumed run meets the batches of the
    # uninterrupted one it is compared with, whatever epoch position the faults left it at.
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, max_steps=args.steps, max_epochs=-1, strategy=strategy,
        use_distributed_sampler=False, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[faults, L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=args.checkpoint_every,
                                                                save_top_k=1, monitor="step", mode="max")],
    )
    trainer.fit(model, loader(batches), ckpt_path=resume)
    state = {"dense": {k: v.clone() for k, v in model.state_dict().items()}, "losses": faults.losses,
             "rollbacks": [vars(e) for e in strategy._recovery.events], "global_step": trainer.global_step}
    if trainer.is_global_zero:
        ids = torch.arange(NUM_IDS)
        state["tables"] = strategy.client.lookup({"ebc.t0": ids, "ebc.t1": ids}, train=False, wire_dtype="fp32")
        state["shard_events"] = [vars(e) for e in strategy._cluster.events] if strategy._cluster else []
    torch.save(state, os.path.join(args.out, f"rank{trainer.global_rank}.pt"))
    strategy.close()


if __name__ == "__main__":
    main()
