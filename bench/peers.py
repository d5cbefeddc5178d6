"""(Copied from the team's shared/bench; baselines in docs/performance.md.)

Peer baselines for full-precision (fp32 master, bf16 compute) training of a HF model.

Modes:
  gpu        everything resident on the GPU (the ceiling for this model/batch)
  fsdp2      torch FSDP2 fully_shard + CPUOffloadPolicy, one rank
  deepspeed  DeepSpeed ZeRO-3 with offload_param + offload_optimizer to CPU, DeepSpeedCPUAdam

Random-init weights from a config (no hub access). Prints 'RESULT {json}'.

--mode deepspeed also runs as N ranks under torchrun (`python -m torch.distributed.run
--nproc-per-node N bench/peers.py --mode deepspeed ...`): --batch rows per GPU, every rank its
own rows; rank 0 prints the job's tokens/s, tokens/s per GPU, the largest GPU peak of any rank
and the ranks' summed host RSS (one node).
"""

import argparse
import json
import os
import time

import torch

PRESETS = {
    # Qwen2.5-3B shape (tied embeddings)
    "qwen2.5-3b": dict(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    # Qwen2.5-7B shape
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        tie_word_embeddings=True,
    ),
}


def out(**kv):
    print("RESULT " + json.dumps(kv), flush=True)


def host_rss_gib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return round(int(line.split()[1]) / 2**20, 1)
    return None


def build(preset, device):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        **PRESETS[preset],
        max_position_embeddings=32768,
        attn_implementation="sdpa",
        use_cache=False,
    )
    if device is None:  # deepspeed.zero.Init decides where parameters live
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True, choices=["gpu", "fsdp2", "deepspeed"])
    ap.add_argument("--preset", default="qwen2.5-3b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--clip", type=float, default=0.0, help="deepspeed gradient_clipping (0: off)")
    a = ap.parse_args()
    if a.accum != 1 and a.mode != "gpu":
        ap.error("--accum is implemented for --mode gpu only")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and a.mode != "deepspeed":
        ap.error("several ranks (torchrun) are implemented for --mode deepspeed only")
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and dev == "cuda":
        dev = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(dev)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    t_build = time.perf_counter()
    if a.mode == "gpu":
        model = build(a.preset, dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev == "cuda")

        def step(x):
            for _ in range(a.accum):
                with torch.autocast(dev, dtype=torch.bfloat16):
                    loss = model(input_ids=x, labels=x).loss / a.accum
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss * a.accum
    elif a.mode == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        dist.init_process_group("nccl" if dev == "cuda" else "gloo")
        model = build(a.preset, dev).cpu()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        off = CPUOffloadPolicy(pin_memory=dev == "cuda")
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp, offload_policy=off)
        fully_shard(model, mp_policy=mp, offload_policy=off)
        for mod in model.modules():
            for name, buf in list(mod.named_buffers(recurse=False)):
                mod._buffers[name] = buf.to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step(x):
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    else:
        import deepspeed

        cfg = {
            "train_micro_batch_size_per_gpu": a.batch,
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "cpu", "pin_memory": True},
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "overlap_comm": True,
                "contiguous_gradients": True,
            },
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
            "gradient_clipping": a.clip,
            "wall_clock_breakdown": False,
        }
        from transformers.integrations import HfDeepSpeedConfig

        deepspeed.init_distributed()
        # With this alive, from_config builds under zero.Init and initialises the partitioned
        # weights.
        dschf = HfDeepSpeedConfig(cfg)  # noqa: F841
        model = build(a.preset, None)
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=cfg
        )

        def step(x):
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            return loss

    t_build = time.perf_counter() - t_build
    n_params = sum(p.numel() for p in model.parameters())
    if a.mode == "deepspeed":
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    vocab = PRESETS[a.preset]["vocab_size"]
    g = torch.Generator().manual_seed(rank)  # every rank its own rows
    x = torch.randint(0, vocab, (a.batch, a.seq), generator=g).to(dev)
    losses, times = [], []
    for i in range(a.steps + 1):
        if dev != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(x)
        losses.append(float(loss))
        if dev != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        print(f"step {i} loss {losses[-1]:.4f} time {times[-1]:.3f}s", flush=True)
    t = sorted(times[1:])[len(times[1:]) // 2]
    tokens = a.batch * a.seq * a.accum * world
    gpu_peak = torch.cuda.max_memory_allocated() / 2**30 if dev != "cpu" else None
    rss = host_rss_gib()
    if world > 1:  # the largest GPU peak of any rank, host RSS summed over the ranks (one node)
        import torch.distributed as dist

        both = torch.tensor([gpu_peak or 0.0, rss or 0.0], dtype=torch.float64, device=dev)
        peak_t, rss_t = both[:1].clone(), both[1:].clone()
        dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
        dist.all_reduce(rss_t)
        gpu_peak, rss = float(peak_t), round(float(rss_t), 1)
        if rank != 0:
            return
    out(
        mode=a.mode,
        preset=a.preset,
        params_b=round(n_params / 1e9, 3),
        batch=a.batch,
        seq=a.seq,
        accum=a.accum,
        clip=a.clip,
        gpus=world,
        step_s=round(t, 3),
        tokens_per_s=round(tokens / t, 1),
        tokens_per_s_per_gpu=round(tokens / t / world, 1),
        model_tflops=round(6 * n_params * tokens / t / 1e12, 1),
        gpu_peak_gib=None if gpu_peak is None else round(gpu_peak, 1),
        host_rss_gib=rss,
        build_s=round(t_build, 1),
        losses=[round(v, 3) for v in losses],
    )


if __name__ == "__main__":
    main()
