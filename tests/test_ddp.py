"""DDP (2 gloo processes on CPU) against one process on the concatenated batch: the inpainting
gradient (mask counts differ between the processes, or are 0 on one) and the logged train_bpd."""
import json
import os
import socket
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from imggen.config import Config, DataConfig, ModelConfig, TrainConfig
from imggen.inpainting.tasks import ddp_mask_norm, inpaint_inputs, token_mask
from imggen.tokens import tokenize
from imggen.training import Run, _dist_setup, batch_indices, build_model_and_optimizer, \
    next_batch, train, train_step

WORLD = 2


def cfg_for(task: str, steps: int = 2) -> Config:
    inpaint = task == "inpaint"
    model = ModelConfig(height=4, width=4, channels=1, bits=3, dim=16, layers=1, heads=2, attention="band", window=7,
                        context="unet" if inpaint else "none", context_width=4)
    train_cfg = TrainConfig(steps=steps, batch_size=4, lr=3e-3, warmup=1, eval_every=1000, eval_images=2,
                            ckpt_every=1000, log_every=1, sample_num=1, grid_time_frac=0, seed=1, grad_clip=1e9,
                            task=task, precision="fp32")  # the equalities below are exact in fp32
    return Config(preset="test", model=model, train=train_cfg, data=DataConfig(spec="synthetic"))


def splits(cfg: Config) -> dict:
    imgs = np.random.default_rng(0).integers(0, 256, (20, 1, cfg.model.height, cfg.model.width), dtype=np.uint8)
    t = tokenize(imgs, cfg.model.bits).to(torch.uint8)
    return {"train": t[:12], "val": t[12:16], "test": t[16:]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, *args):
    """Runs fn(rank, *args) in WORLD processes that torchrun's environment makes one DDP job."""
    mp.spawn(_entry, args=(free_port(), fn, *args), nprocs=WORLD, join=True)


def _entry(rank, port, fn, *args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    fn(rank, *args)


def empty_second_half(masks: np.ndarray) -> np.ndarray:
    """Rank 1 (the odd images of the global batch) scores no pixel."""
    masks = masks.copy()
    masks[1::WORLD] = False
    return masks


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def two_steps(model, opt, cfg, data, rank, world, net):
    """Step 0 as training draws it (the processes' mask counts differ), then step 1 with a loss
    mask that leaves rank 1 (of 2) nothing to score. -> [(grads, returned bpd)] per step."""
    run, out = Run(cfg, "", "cpu", rank, world, model, opt, data), []
    x, context, loss_mask, norm = next_batch(run)
    out.append((grads_after(net, opt, x, 0, cfg, context, loss_mask, norm, model), float(loss_mask.sum())))
    m = cfg.model
    idx = batch_indices(1, cfg.train.batch_size, len(data["train"]), cfg.train.seed)
    masks = np.random.default_rng(5).random((len(idx), m.height, m.width)) < 0.5
    masks[:, 0, 0] = True  # a context needs an unknown pixel; the loss mask may have none
    x = data["train"][idx[rank::world]].long()
    context, _ = inpaint_inputs(model, x, masks[rank::world])
    scored = empty_second_half(masks)
    loss_mask = token_mask(torch.from_numpy(scored[rank::world]), m.channels)
    norm = ddp_mask_norm(scored, m.channels, world)
    out.append((grads_after(net, opt, x, 1, cfg, context, loss_mask, norm, model), float(loss_mask.sum())))
    return out


def grads_after(net, opt, x, step, cfg, context, loss_mask, norm, model):
    bpd = train_step(net, opt, x, step, cfg, "cpu", None, context, loss_mask, norm)
    return grads(model).clone(), bpd


def _grad_worker(rank, cfg, data, out_dir):
    _dist_setup()
    model, opt = build_model_and_optimizer(cfg, "cpu")
    net = torch.nn.parallel.DistributedDataParallel(model)
    torch.save(two_steps(model, opt, cfg, data, rank, WORLD, net), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_ddp_inpaint_gradient_is_the_single_process_gradient_of_the_global_batch(tmp_path):
    cfg = cfg_for("inpaint")
    data = splits(cfg)
    spawn(_grad_worker, cfg, data, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    model, opt = build_model_and_optimizer(cfg, "cpu")
    single = two_steps(model, opt, cfg, data, 0, 1, model)
    for step, ((g1, bpd1), count) in enumerate(single):
        counts = [ranks[r][step][1] for r in range(WORLD)]
        assert sum(counts) == count and len(set(counts)) == WORLD  # the ranks' shares differ
        for r in range(WORLD):
            (g, bpd), _ = ranks[r][step]
            assert torch.isfinite(g).all()
            assert rel_err(g, g1) < 1e-6, (step, r, rel_err(g, g1))
        # the processes' returned losses average to the global batch's (what training logs)
        mean = sum(ranks[r][step][0][1] for r in range(WORLD)) / WORLD
        assert mean == pytest.approx(bpd1, rel=1e-6)
    assert single[1][1] > 0 and ranks[1][1][1] == 0  # step 1: rank 1 scores nothing


def _train_worker(rank, cfg, data, out):
    train(cfg, out, data=data, progress=False)


def train_bpd(out: str) -> list[float]:
    rows = [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]
    return [r["train_bpd"] for r in rows if "train_bpd" in r]


@pytest.mark.parametrize("task,augment", [("generate", False), ("inpaint", False), ("generate", True),
                                          ("inpaint", True)])
def test_ddp_logged_train_bpd_is_the_single_process_one(tmp_path, task, augment):
    cfg = cfg_for(task)
    cfg.train.augment = augment  # the warps are drawn for the global batch: each process warps its share alike
    data = splits(cfg)
    spawn(_train_worker, cfg, data, str(tmp_path / "two"))
    train(cfg, str(tmp_path / "one"), data=data, progress=False)
    one, two = train_bpd(str(tmp_path / "one")), train_bpd(str(tmp_path / "two"))
    assert len(one) == len(two) == cfg.train.steps
    assert two == pytest.approx(one, rel=1e-6)


def _restarted_worker(rank, port, attempt, late):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), TORCHELASTIC_USE_AGENT_STORE="True",
                      TORCHELASTIC_RESTART_COUNT=str(attempt))
    time.sleep(late if rank == 0 else 0)
    _dist_setup()
    x = torch.ones(1)
    dist.all_reduce(x)
    assert x.item() == WORLD
    dist.destroy_process_group()


def test_a_group_torchrun_restarts_connects_on_the_store_the_group_before_it_used():
    """torchrun's static rendezvous (its default with --master_port) serves one store, its agent's, to
    every group it starts. A restarted group whose rank 0 came late read the dead group's gloo addresses
    there: connection refused, or both ranks waiting for the other (issue 37)."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=60))  # as torchrun's agent hosts it
    for attempt in range(4):  # each restart's rank 0 late: unfixed, 3 of 4 such restarts failed or hung
        group = mp.spawn(_restarted_worker, args=(port, attempt, 2.0 if attempt else 0.0), nprocs=WORLD, join=False)
        deadline = time.time() + 60
        while not group.join(timeout=1):
            if time.time() > deadline:
                for p in group.processes:
                    p.kill()
                pytest.fail(f"the group of attempt {attempt} hung connecting")
    del store
