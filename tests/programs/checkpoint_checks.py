"""Controller program for tests/test_checkpoint_world.py: one 1 + 4 rank world, every check of the
distributed checkpoint on the tiny Qwen2 (fp32, CPU workers).

    python launchers/hpcrl_entry.py tests/programs/checkpoint_checks.py OUT.json   (under the command
    hpcrl.launch.mpiexec_command(4, ...) builds: see tests/test_checkpoint_world.py)

A: actor at TP=2 (DP=2) takes 2 optimizer steps, is saved (sync) and committed as step 2, saved
again asynchronously while it takes step 3, and committed as step 3.
B: a fresh actor at TP=2 loads step 2: its re-save must be byte-identical to A's, and the same
step 3 must give byte-identical files to A's step 3 (a resumed run is bit-exact).
C: a fresh actor at TP=1 (DP=4) loads step 2 (converted): log-probs within 1e-5 of A's, an update
runs; its re-save, joined back into HF tensors, must equal step 2's for every tensor kind.
Export: `ckpt export-hf` of step 2, HF transformers log-probs within 1e-5 of A's.
Disk full: the trainer's Checkpointer saves P onto a tmpfs that holds 1.5 of its checkpoints:
refused up front, then (the estimate bypassed) failing in the workers' writes, sync and async.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "models" / "tiny-qwen2")


def _sibling(name: str) -> Any:
    """tests/programs/megatron_checks.py by path (programs are loaded by path, not as a package)."""
    spec = importlib.util.spec_from_file_location(f"_hpcrl_{name}", Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def shard_hashes(store: Any, path: Path, role: str = "actor") -> dict[str, str]:
    return {p: r["sha256"] for p, r in store.manifest(path)["files"].items() if p.startswith(f"{role}/")}


def shard_differences(a_dir: Path, b_dir: Path) -> list[str]:
    """What differs between two saves of one layout (tensor by tensor, metadata key by key): the
    message of a failing byte-identity check."""
    from safetensors.torch import load_file

    out = []
    for f in sorted(p.name for p in a_dir.iterdir()):
        ra, rb = (open(d / f, "rb").read() for d in (a_dir, b_dir))
        if ra != rb:
            first = next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), min(len(ra), len(rb)))
            out.append(f"{f}: bytes differ from offset {first} (sizes {len(ra)}, {len(rb)}): "
                       f"{ra[max(first - 40, 0):first + 40]!r} vs {rb[max(first - 40, 0):first + 40]!r}")
        if f.endswith(".json"):
            ma, mb = (json.loads((d / f).read_text()) for d in (a_dir, b_dir))
            out += [f"{f}: {k}: {ma.get(k)!r} vs {mb.get(k)!r}" for k in sorted(ma.keys() | mb.keys())
                    if ma.get(k) != mb.get(k)]
        else:
            ta, tb = load_file(str(a_dir / f)), load_file(str(b_dir / f))
            out += [f"{f}: {k} only in one" for k in sorted(ta.keys() ^ tb.keys())]
            out += [f"{f}: {k} differs (max abs {float((ta[k].double() - tb[k].double()).abs().max()):.3g}, "
                    f"dtypes {ta[k].dtype}/{tb[k].dtype})" for k in sorted(ta.keys() & tb.keys())
                    if not torch.equal(ta[k], tb[k]) or ta[k].dtype != tb[k].dtype]
    return out


def load_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def same_rng(a: Path, b: Path) -> bool:
    """Two saved RNG files hold the same states (compared as values, not as pickle bytes)."""

    def eq(x: Any, y: Any) -> bool:
        if torch.is_tensor(x):
            return torch.is_tensor(y) and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return isinstance(y, (list, tuple)) and len(x) == len(y) and all(eq(u, v) for u, v in zip(x, y))
        return x == y

    return eq(torch.load(a, weights_only=True)["state"], torch.load(b, weights_only=True)["state"])


def masked_max(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a.double() - b.double()).abs() * mask).max())


def hf_state_diff(a_dir: Path, b_dir: Path) -> dict[str, Any]:
    """Join both saves' shards back into HF-named tensors, every kind; max abs difference and
    whether all are bit-equal (a layout conversion is pure slicing: it must be exact)."""
    from hpcrl.checkpoint.megatron_state import SavedRole

    a, b = SavedRole(a_dir), SavedRole(b_dir)
    out: dict[str, Any] = {"kinds": a.kinds(), "tensors": 0, "bit_equal": True, "max_abs": 0.0}
    assert a.kinds() == b.kinds(), (a.kinds(), b.kinds())
    for kind in a.kinds():
        full_a = {k: v for pp in range(a.pp) for u in a.units(pp) for k, v in a.unit_hf(kind, pp, u).items()}
        full_b = {k: v for pp in range(b.pp) for u in b.units(pp) for k, v in b.unit_hf(kind, pp, u).items()}
        assert full_a.keys() == full_b.keys(), (kind, sorted(full_a.keys() ^ full_b.keys())[:5])
        for k in full_a:
            out["tensors"] += 1
            out["bit_equal"] &= torch.equal(full_a[k], full_b[k])
            out["max_abs"] = max(out["max_abs"], float((full_a[k] - full_b[k]).abs().max()))
    return out


def mount_tmpfs(path: Path, size: int) -> str | None:
    """Mount a tmpfs of `size` bytes at `path` (a real full disk); why not, when it cannot be."""
    if os.geteuid() != 0:
        return "a full disk is made with `mount -t tmpfs`, which needs root"
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    return None if r.returncode == 0 else f"mount -t tmpfs is not permitted here: {r.stderr.strip()}"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def disk_full_checks(group: Any, ckpt_bytes: int, batch: Any, tmp: Path) -> dict[str, Any]:
    """The trainer's Checkpointer (a stand-in trainer: only its group is real) saving `group`, on
    every worker, onto a tmpfs that holds 1.5 of its checkpoints. The first save fits; the second
    is refused up front; with the estimate bypassed (the disk filled after the check) the workers'
    writes run out, sync and async. After each: the error on the controller, the partial save
    removed, step 2 the latest valid checkpoint; at the end every rank answers as before. `group`
    must be the last one built: megatron's parallel state is one per process, the last layout's."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from hpcrl.trainer.main import Checkpointer

    mnt = tmp / "full"
    why = mount_tmpfs(mnt, int(1.5 * ckpt_bytes) // 4096 * 4096)
    if why:
        return {"skipped": why}
    log = _Records()
    logging.getLogger("hpcrl").addHandler(log)
    out: dict[str, Any] = {"root": str(mnt / "checkpoints")}
    try:
        logprob = group.compute_logprob(batch)
        cfg = OmegaConf.create({"checkpoint": {"dir": out["root"], "keep_last": 2, "keep_every": 0,
                                               "async_save": False, "resume": "never", "on_save_error": "stop"}})
        counter = SimpleNamespace(state_dict=lambda: {"epoch": 0})
        trainer = SimpleNamespace(step=2, sampler=counter, kl_ctrl=counter, trained_groups=lambda: [group])
        ck = Checkpointer(cfg, trainer, SimpleNamespace(cursor=lambda: 0))
        store = ck.store
        out["first_saved"] = ck.save(wait=True)
        first, free = store.latest_valid(), store.free_bytes()

        def after(name: str) -> None:
            out[f"{name}_log"] = log.messages[-1] if log.messages else ""
            valid = store.latest_valid(verify_checksums=True)
            out[f"{name}_state"] = {"latest_valid": valid.name if valid else None,
                                    "steps": [i.step for i in store.list()],
                                    "debris": sorted(p.name for p in store.root.iterdir() if p.name.startswith(".")),
                                    "free_back": store.free_bytes() == free,
                                    "first_verifies": store.verify(first, checksums=True) == []}

        trainer.step = 3
        out["refused_returned"] = ck.save(wait=True)
        after("refused")
        store.check_space = lambda step, needed: None  # someone else filled the disk after the check
        out["sync_returned"] = ck.save(wait=True)
        after("sync")
        ck.async_save = True
        out["async_save_returned"] = ck.save()
        out["async_finish_returned"] = ck.finish_pending()
        after("async")
        out["wait_after"] = group.wait_checkpoint()
        out["logprob_equal"] = bool(torch.equal(group.compute_logprob(batch), logprob))
    finally:
        logging.getLogger("hpcrl").removeHandler(log)
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    return out


def main() -> None:
    from omegaconf import OmegaConf

    from hpcrl import cli_ckpt
    from hpcrl.checkpoint import CheckpointStore
    from hpcrl.controller import WorkerGroup, get_runtime
    from hpcrl.workers.batching import arrange_minibatches
    from hpcrl.workers.megatron_roles import MegatronRole

    out_path = sys.argv[1]
    workers = get_runtime().world.size - 1
    assert workers % 2 == 0, f"the checkpoint checks need an even number of workers, got {workers}"
    mc = _sibling("megatron_checks")
    tmp = Path(tempfile.mkdtemp(prefix="hpcrl-ckpt-"))
    res: dict[str, Any] = {"workers": workers, "timings": {}}
    t_all = time.time()
    t = time.time()

    def lap(name: str) -> None:
        nonlocal t
        res["timings"][name] = round(time.time() - t, 2)
        print(f"[checkpoint_checks] {name}: {res['timings'][name]} s", flush=True)
        t = time.time()

    cfg2 = mc.make_cfg(TINY, 2, 1, **{"optim.lr": 1e-3})
    cfg1 = mc.make_cfg(TINY, 1, 1, **{"optim.lr": 1e-3})
    config_yaml = OmegaConf.to_yaml(OmegaConf.create(cfg2))
    batch = mc.text_batch(TINY, 8)
    mask = batch["attention_mask"].clone()
    mask[:, 0] = 0
    g = torch.Generator().manual_seed(0)
    batch["advantages"] = torch.randn(batch["input_ids"].shape, generator=g)
    run_dir = tmp / "run"
    store = CheckpointStore(run_dir / "checkpoints", keep_last=2)

    def commit(st: CheckpointStore, step: int, tmp_dir: Path, records: Any) -> Path:
        return st.commit(tmp_dir, step, records, {"step": step, "sampler": {"epoch": 0, "index": 8 * step}},
                         config_yaml)

    # A: TP=2, two optimizer steps, sync save of step 2 --------------------------------------------
    a = WorkerGroup(MegatronRole, init_kwargs={"cfg": cfg2, "role": "actor"}, name="ckpt-A")
    batch["old_logprob"] = a.compute_logprob(batch)
    lap("A build")
    dp2 = a.layout.dp_size
    res["update_12"] = a.update_actor(arrange_minibatches(copy.copy(batch), 2, dp2, "token-mean"), num_minibatches=2)
    lp2 = a.compute_logprob(batch)
    lap("A 2 steps")
    t0 = time.time()
    tmp2 = store.begin(2)
    recs = a.save_checkpoint(str(tmp2))
    res["save_sync_s"] = round(time.time() - t0, 3)
    ck2 = commit(store, 2, tmp2, recs)
    res["commit_s"] = round(time.time() - t0 - res["save_sync_s"], 3)
    m2 = store.manifest(ck2)
    res["ck2"] = {"files": sorted(m2["files"]), "total_bytes": m2["total_bytes"],
                  "records_per_rank": [len(r) for r in recs],
                  "controller_state": store.load_controller_state(ck2)}
    lap("A save+commit step 2")

    # A: async save of the same state, overlapped with step 3 --------------------------------------
    store_async = CheckpointStore(tmp / "async" / "checkpoints")
    tmpa = store_async.begin(2)
    t0 = time.time()
    res["async_save_returned"] = a.save_checkpoint(str(tmpa), async_save=True)
    res["async_call_s"] = round(time.time() - t0, 3)
    arranged3 = arrange_minibatches(copy.copy(batch), 1, dp2, "token-mean")
    res["update_3_A"] = a.update_actor(arranged3)
    recs_async = a.wait_checkpoint()
    cka = commit(store_async, 2, tmpa, recs_async)
    res["async_equals_sync"] = shard_hashes(store_async, cka) == shard_hashes(store, ck2)
    res["async_differences"] = shard_differences(ck2 / "actor", cka / "actor")[:20]
    lp3 = a.compute_logprob(batch)
    tmp3 = store.begin(3)
    ck3 = commit(store, 3, tmp3, a.save_checkpoint(str(tmp3)))
    lap("A async save + step 3 + save")

    # B: TP=2 again, same-layout load -> byte-identical state, bit-exact continuation --------------
    b = WorkerGroup(MegatronRole, init_kwargs={"cfg": cfg2, "role": "actor"}, name="ckpt-B")
    res["load_B"] = b.load_checkpoint(str(ck2))
    lap("B build + load")
    res["B_logprob_equal"] = bool(torch.equal(b.compute_logprob(batch), lp2))
    store_b = CheckpointStore(tmp / "b" / "checkpoints")
    tb = store_b.begin(2)
    ckb = commit(store_b, 2, tb, b.save_checkpoint(str(tb)))
    res["B_resave_equals_A"] = shard_hashes(store_b, ckb) == shard_hashes(store, ck2)
    res["B_resave_differences"] = shard_differences(ck2 / "actor", ckb / "actor")[:20]
    res["B_rng_equals_A"] = all(same_rng(ck2 / "rng" / f"rank{r}.pt", ckb / "rng" / f"rank{r}.pt")
                                for r in range(workers))
    res["update_3_B"] = b.update_actor(arranged3)
    res["B_step3_logprob_equal"] = bool(torch.equal(b.compute_logprob(batch), lp3))
    tb3 = store_b.begin(3)
    ckb3 = commit(store_b, 3, tb3, b.save_checkpoint(str(tb3)))
    res["B_step3_equals_A"] = shard_hashes(store_b, ckb3) == shard_hashes(store, ck3)
    res["B_step3_differences"] = shard_differences(ck3 / "actor", ckb3 / "actor")[:20]
    res["B_step3_files"] = len(shard_hashes(store_b, ckb3))
    lap("B checks")

    # U: the same layout with every DP rank keeping the whole optimizer state (A and B cut it over
    # DP: actor.optim.shard_over_dp, the default): A's save loads, and step 3 writes the same bytes
    # as A's step 3 (the same update; a sharded save and an unsharded one are one format)
    cfg2_whole = copy.deepcopy(cfg2)
    cfg2_whole["actor"]["optim"]["shard_over_dp"] = False
    u = WorkerGroup(MegatronRole, init_kwargs={"cfg": cfg2_whole, "role": "actor"}, name="ckpt-U")
    res["load_U"] = u.load_checkpoint(str(ck2))
    res["optimizer_bytes"] = {"sharded": b.optimizer_state_bytes(), "whole": u.optimizer_state_bytes()}
    res["update_3_U"] = u.update_actor(arranged3)
    store_u = CheckpointStore(tmp / "u" / "checkpoints")
    tu3 = store_u.begin(3)
    cku3 = commit(store_u, 3, tu3, u.save_checkpoint(str(tu3)))
    tensors_u, tensors_a = ({k: v for k, v in shard_hashes(st, ck).items() if k.endswith(".safetensors")}
                            for st, ck in ((store_u, cku3), (store, ck3)))
    res["U_step3_tensors_equal_A"] = len(tensors_a) == 2 and tensors_u == tensors_a
    # the metadata differs in the setting alone
    res["U_step3_differences"] = shard_differences(ck3 / "actor", cku3 / "actor")
    lap("U (optimizer state not sharded) checks")

    # D, E: bf16 with fp32 master weights at TP=2: save, load, byte-identical re-save --------------
    cfg2_bf16 = copy.deepcopy(cfg2)
    cfg2_bf16["model"]["dtype"] = "bf16"
    d = WorkerGroup(MegatronRole, init_kwargs={"cfg": cfg2_bf16, "role": "actor"}, name="ckpt-D")
    d.update_actor(arrange_minibatches(copy.copy(batch), 2, dp2, "token-mean"), num_minibatches=2)
    store_bf16 = CheckpointStore(tmp / "bf16" / "checkpoints")
    td = store_bf16.begin(2)
    ckd = commit(store_bf16, 2, td, d.save_checkpoint(str(td)))
    e = WorkerGroup(MegatronRole, init_kwargs={"cfg": cfg2_bf16, "role": "actor"}, name="ckpt-E")
    res["load_E"] = e.load_checkpoint(str(ckd))
    store_e = CheckpointStore(tmp / "e" / "checkpoints")
    te = store_e.begin(2)
    cke = commit(store_e, 2, te, e.save_checkpoint(str(te)))
    res["E_resave_equals_D"] = shard_hashes(store_e, cke) == shard_hashes(store_bf16, ckd)
    res["E_resave_differences"] = shard_differences(ckd / "actor", cke / "actor")[:20]
    res["D_tensor_kinds"] = sorted({k.split("::")[0] for k in load_keys(ckd / "actor" / "pp0_tp0.safetensors")})
    lap("D, E bf16 checks")

    # C: TP=1 (DP=4), load the TP=2 save (converted) -----------------------------------------------
    c = WorkerGroup(MegatronRole, init_kwargs={"cfg": cfg1, "role": "actor"}, name="ckpt-C")
    res["load_C"] = c.load_checkpoint(str(ck2))
    lap("C build + load")
    lpc = c.compute_logprob(batch)
    res["C_logprob_vs_A"] = masked_max(lpc, lp2, mask)
    store_c = CheckpointStore(tmp / "c" / "checkpoints")
    tc = store_c.begin(2)
    ckc = commit(store_c, 2, tc, c.save_checkpoint(str(tc)))
    res["C_resave_files"] = sorted(p for p in store_c.manifest(ckc)["files"] if p.startswith("actor/"))
    res["C_vs_A_hf_state"] = hf_state_diff(ck2 / "actor", ckc / "actor")
    meta_a, meta_c = (json.loads((d / "actor" / "pp0_tp0.json").read_text()) for d in (ck2, ckc))
    res["C_resave_meta"] = {"step_count": meta_c["step_count"], "adam_step": meta_c["optimizer"]["step"],
                            "param_groups_equal": meta_c["optimizer"]["param_groups"] == meta_a["optimizer"][
                                "param_groups"]}
    res["update_3_C"] = c.update_actor(arrange_minibatches(copy.copy(batch), 1, c.layout.dp_size, "token-mean"))
    res["C_step3_logprob_vs_A"] = masked_max(c.compute_logprob(batch), lp3, mask)
    res["step3_change_vs_step2"] = masked_max(lp3, lp2, mask)
    lap("C checks")

    # F: the bf16 TP=2 save loaded at TP=1 bf16 (masters converted too) ---------------------------
    cfg1_bf16 = copy.deepcopy(cfg1)
    cfg1_bf16["model"]["dtype"] = "bf16"
    f = WorkerGroup(MegatronRole, init_kwargs={"cfg": cfg1_bf16, "role": "actor"}, name="ckpt-F")
    res["load_F"] = f.load_checkpoint(str(ckd))
    store_f = CheckpointStore(tmp / "f" / "checkpoints")
    tf = store_f.begin(2)
    ckf = commit(store_f, 2, tf, f.save_checkpoint(str(tf)))
    res["F_vs_D_hf_state"] = hf_state_diff(ckd / "actor", ckf / "actor")
    lap("F bf16 TP=1 checks")

    # P: TP=1 PP=2 (tied embeddings: the last stage's output-layer copy and its Adam state come
    # from the saved embedding) ------------------------------------------------------------------
    cfg_pp = mc.make_cfg(TINY, 1, 2, **{"optim.lr": 1e-3})
    pg = WorkerGroup(MegatronRole, init_kwargs={"cfg": cfg_pp, "role": "actor"}, name="ckpt-P")
    res["load_P"] = pg.load_checkpoint(str(ck2))
    res["P_logprob_vs_A"] = masked_max(pg.compute_logprob(batch), lp2, mask)
    res["update_3_P"] = pg.update_actor(arrange_minibatches(copy.copy(batch), 1, pg.layout.dp_size, "token-mean"))
    res["P_step3_logprob_vs_A"] = masked_max(pg.compute_logprob(batch), lp3, mask)
    store_p = CheckpointStore(tmp / "p" / "checkpoints")
    tp_ = store_p.begin(3)
    ckp = commit(store_p, 3, tp_, pg.save_checkpoint(str(tp_)))
    res["P_files"] = sorted(p for p in store_p.manifest(ckp)["files"] if p.startswith("actor/"))
    res["P_vs_A_step3_hf_state"] = hf_state_diff(ck3 / "actor", ckp / "actor")
    lap("P TP=1 PP=2 checks")

    # export-hf of step 2 (offline code path, run here to reuse the loaded tokenizer/HF stack) -----
    out_hf = tmp / "exported"
    res["cli_verify_rc"] = cli_ckpt.main(["ckpt", "verify", str(run_dir)])
    res["cli_export_rc"] = cli_ckpt.main(["ckpt", "export-hf", str(run_dir), "--out", str(out_hf), "--step", "2"])
    res["export_files"] = sorted(p.name for p in out_hf.iterdir())
    res["export_hf_logprob_vs_A"] = masked_max(mc.hf_logprobs(str(out_hf), batch), lp2, mask)
    res["list"] = [(i.step, i.valid, i.latest, i.size) for i in store.list()]
    lap("export-hf + HF log-probs")

    res["disk_full"] = disk_full_checks(pg, store_p.manifest(ckp)["total_bytes"], batch, tmp)
    lap("disk full")

    res["timings"]["total"] = round(time.time() - t_all, 1)
    Path(out_path).write_text(json.dumps(res, indent=1, default=str))
    shutil.rmtree(tmp, ignore_errors=True)
