"""`plexrl bench sample`: decode throughput of batched sampling against today's loop and the
memory-bound limit, the vLLM sampler against the Hugging Face path, and a vLLM state's switch
timings.

0) in this process, no cluster (bench/decode_sweep.py): tokens/s against live batch size
   (`--sweep`, 1 to 256) of the one-request loop and of batched sampling (a captured graph per
   step on CUDA), each beside the memory-bound limit measured in the same run (a device-to-device
   copy's bandwidth over the bytes a decode step reads); and a rollout A/B on the demo's model
   (`--rollout`, default 64 prompts x 8 samples x 32 tokens): one call per prompt one after the
   other, as today's loop, against one batched call.
Then through the real runtime (a LocalCluster of one device):

A Llama built from a config (`--model-size tiny|1b`, or sizes from flags; random weights, a char
vocabulary, no EOS so every sequence decodes all its tokens: the HF loop decodes stopped rows
anyway, vLLM drops them) serves three frozen states of one base model on the device:
1) decode: `sample` of `--batch` sequences x `--max-tokens` new tokens from one prompt, after a
   warm-up call, on sampler="hf" and on sampler="vllm"; tokens per second of the call's own time
   (its `end` event's `wall_s`: the function, not its switch-in), the median of `--repeats`, and
   `vllm_vs_hf` (the target on GPU, issue #15: >= 5 at a batch of 64);
2) switches: two jobs' frozen models of the base take turns on the device's one vLLM engine, the
   arena holding one of them, so each call is a switch: switch-out puts the engine to sleep
   (level 2, CUDA; skipped on CPU, `vllm_sleep` says why), switch-in copies the state into the
   arena, wakes the engine and pushes the state's weights from its host buffer (a `load`
   transition's seconds include the push: device_worker._load). Medians over `--switches`, the
   first round left out (a state's first push maps a fresh file). Its reference, measured in the
   same run: `vllm_push_copy_s`, the push's bytes over a page-locked host-to-device copy's speed;
   `vllm_switch_in_vs_copy` their ratio (the state's bytes move twice, into the arena and into the
   engine, so 2 is its floor; the target on GPU: <= 4, the wake and the rest in what is left).

vLLM runs when the runtime can start it (`PLEXRL_VLLM_PYTHON`, samplers/vllm_sampler.py); else
the HF figures come with `vllm_skipped`, the reason, and the command still succeeds.

The device budget is sized from the model: the activation reserve the runtime would measure for
calls of this size (runtime/activation.py, on `--batch` x (prompt + max tokens) tokens, measured
once here and passed on), the vLLM engine's share (vllm_sampler.engine_share_bytes: on CUDA its
gpu_memory_utilization of the device) and one and a half states; `budget_*` is the split the
cluster reports (`metrics()["device_budget"]`).

Out of scope: vLLM in the sweep (it runs at `--batch` only), prompts of more than one distinct
sequence in the runtime part.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from plexrl.bench.common import emit, median

# hidden, layers, heads, intermediate. tiny: head_dim 32 (vLLM's CPU attention refuses 16).
# 1b: TinyLlama's widths; with a char vocabulary 20 layers make ~1.03B parameters. Only sensible on GPU.
PRESETS = {"tiny": (64, 2, 2, 176), "1b": (2048, 20, 32, 5632)}
SAMPLERS = ("hf", "vllm")


def build_model(folder: str, hidden: int, layers: int, heads: int, intermediate: int, positions: int) -> Path:
    """A Llama of these sizes whose config names no EOS token (no sequence stops early)."""
    import transformers

    from plexrl.models.tiny import make_tiny_model

    transformers.utils.logging.disable_progress_bar()  # stdout is the result; stderr stays readable
    model = make_tiny_model(folder, hidden_size=hidden, num_layers=layers, num_heads=heads,
                            intermediate_size=intermediate, max_position_embeddings=positions)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((model / name).read_text())
        config["eos_token_id"] = None
        (model / name).write_text(json.dumps(config, indent=2))
    return model


def vllm_missing(samplers: list[str]) -> str | None:
    """Why the vLLM part does not run, or None when it does (the runtime's own check)."""
    from plexrl.api import errors
    from plexrl.samplers.vllm_sampler import vllm_python

    if "vllm" not in samplers:
        return f"not asked for (--samplers {','.join(samplers)})"
    try:
        vllm_python()
    except errors.InvalidInput as exc:
        return str(exc)
    return None


def device_budget(model: Path, tokens: int, device: str, state_bytes: int, vllm: bool) -> tuple[int, int]:
    """(device_memory_bytes, activation reserve): room for the reserve of calls of `tokens` tokens,
    the vLLM engine's share when it runs, and one and a half states (so the arena holds one)."""
    from plexrl.runtime import activation
    from plexrl.runtime.state import load_module
    from plexrl.samplers.vllm_sampler import engine_share_bytes

    template = load_module(model)
    reserve = activation.measure_reserve(template, tokens, device)
    weights = sum(p.numel() * p.element_size() for p in template.parameters())  # as a device worker counts them
    share = engine_share_bytes(device, weights) if vllm else 0
    return reserve + share + state_bytes * 3 // 2, reserve


def decode(cluster, client, prompt, batch: int, max_tokens: int, repeats: int) -> dict:
    """Tokens per second of `sample` calls on `client`'s state, after a warm-up call."""
    import plexrl

    params = plexrl.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0)
    client.sample(prompt, batch, params).result()  # the engine's start, the first load and push, kernels
    rates, tokens, seconds = [], 0, []
    for _ in range(repeats):
        skip = len(cluster.events())
        out = client.sample(prompt, batch, params).result()
        end = next(e for e in cluster.events()[skip:] if e["event"] == "end" and e.get("fn") == "sample")
        tokens = sum(len(s.tokens) for s in out.sequences)
        seconds.append(end["wall_s"])
        rates.append(tokens / end["wall_s"])
    return {"tokens_per_s": median(rates), "decode_s": median(seconds), "tokens": tokens}


def switches(cluster, clients, prompt, count: int) -> dict:
    """Switch-in and switch-out seconds of vLLM states taking turns on one engine."""
    clients[0].compute_logprobs(prompt).result()  # resident, so that every call below is a switch
    skip = len(cluster.events())
    for i in range(1, 1 + count + len(clients)):
        clients[i % len(clients)].compute_logprobs(prompt).result()
    ids = {client.state.state_id for client in clients}
    moves = [e for e in cluster.events()[skip:] if e["event"] == "transition" and e["state"] in ids]
    loads = [e for e in moves if e["kind"] == "load"][len(clients):]  # a state's first push maps a fresh file
    offloads = [e for e in moves if e["kind"] == "offload"][len(clients):]
    if not loads:
        raise RuntimeError(f"no vLLM state was switched in ({len(moves)} transitions); expected the arena to hold "
                           "one of the two states")
    return {"switch_in_s": median([e["seconds"] for e in loads]), "switch_in_s_max": max(e["seconds"] for e in loads),
            "switch_out_s": median([e["seconds"] for e in offloads]) if offloads else 0.0,
            "switches": len(loads), "push_bytes": loads[-1]["bytes"], "sleep": sleep_outcome(cluster)}


def sleep_outcome(cluster) -> str:
    """How the engine went to sleep on switch-out: 'level 2', or why it was skipped (CPU)."""
    engines = cluster.workers[0].target.samplers.engines.values()  # the local engine's only device
    skipped = [reason for engine in engines for reason in engine.skipped]
    return skipped[0] if skipped else "level 2"


def table(result: dict) -> None:
    """The sweep as its own table, then every other figure."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if result.get("sweep"):
        sweep = Table(title=f"decode tokens/s by live batch ({'graph' if result['graph'] else 'eager'} steps; bound: "
                            f"{result['copy_bandwidth_gbps']:.1f} GB/s copy bandwidth over the bytes a step reads)")
        for column in ("batch", "loop", "batched", "bound", "loop/bound", "batched/bound", "batched/loop"):
            sweep.add_column(column, justify="right")
        for row in result["sweep"]:
            sweep.add_row(str(row["batch"]), *(f"{row[k]:,.0f}" for k in ("loop_tokens_per_s", "batched_tokens_per_s",
                                                                           "bound_tokens_per_s")),
                          *(f"{row[k]:.3g}" for k in ("loop_of_bound", "batched_of_bound", "batched_vs_loop")))
        console.print(sweep)
    figures = Table(title="sample")
    figures.add_column("figure")
    figures.add_column("value", justify="right")
    for key, value in result.items():
        if key != "sweep":
            figures.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(figures)


def run(args) -> dict:
    import plexrl
    from plexrl.engines.local import LocalCluster
    from plexrl.models.tiny import parameter_count
    from plexrl.runtime import precision as precisions

    samplers = [s for s in args.samplers.split(",") if s]
    skipped = vllm_missing(samplers)
    hidden, layers, heads, intermediate = (given if given is not None else preset for given, preset in zip(
        (args.hidden, args.layers, args.heads, args.intermediate), PRESETS[args.model_size]))
    resolved = precisions.resolve(args.precision, args.device)
    per_weight = precisions.state_dtypes(resolved, False, None)[0].itemsize
    positions = args.prompt_tokens + args.max_tokens
    tokens = args.batch * positions
    result = {"device": args.device, "precision": resolved, "batch": args.batch, "max_tokens": args.max_tokens,
              "prompt_tokens": args.prompt_tokens, "hidden": hidden, "layers": layers, "heads": heads,
              "intermediate": intermediate}
    with tempfile.TemporaryDirectory() as folder:
        # 1) the model, and a budget sized from it
        model = build_model(f"{folder}/model", hidden, layers, heads, intermediate, positions)
        result["parameters"] = parameter_count(model)
        # 0) the decode sweep and the rollout A/B, outside the runtime
        result.update(decode_figures(args, model, folder))
        state_bytes = per_weight * result["parameters"]
        budget, reserve = device_budget(model, tokens, args.device, state_bytes, skipped is None)
        # prefetch off: each switch-in is a load planned before its call, not one hidden behind the last call
        with LocalCluster(devices=1, device_memory_bytes=budget, host_memory_bytes=4 * state_bytes + (64 << 20),
                          activation_reserve_bytes=reserve, torch_device=args.device, precision=args.precision,
                          threads_per_device=args.threads, prefetch=False, workdir=f"{folder}/cluster") as cluster:
            # 2) every state first, so the first load already sees the budget's final split
            clients = {"hf": cluster.service_client("decode").create_sampling_client(model, name="hf")}
            if skipped is None:
                clients["vllm"] = [cluster.service_client(job).create_sampling_client(model, name="rollouts",
                                                                                      sampler="vllm")
                                   for job in ("a", "b")]
            split = cluster.metrics()["device_budget"][0]
            result.update({f"budget_{key}": value for key, value in split.items()})
            if skipped is None and split["state_bytes"] // state_bytes != 1:
                raise RuntimeError(f"the arena holds {split['state_bytes']:,} bytes of states, not one of "
                                   f"{state_bytes:,} (device budget {split}): the two vLLM states would not switch")
            prompt = plexrl.ModelInput.from_ints([5 + i % 50 for i in range(args.prompt_tokens)])
            # 3) decode throughput, HF then vLLM
            if "hf" in samplers:
                result.update({f"hf_{k}": v for k, v in decode(cluster, clients["hf"], prompt, args.batch,
                                                                args.max_tokens, args.repeats).items()})
            if skipped is None:
                result.update({f"vllm_{k}": v for k, v in decode(cluster, clients["vllm"][0], prompt, args.batch,
                                                                  args.max_tokens, args.repeats).items()})
                # 4) switches between two jobs' states on the one engine
                result.update({f"vllm_{k}": v for k, v in switches(cluster, clients["vllm"], prompt,
                                                                    args.switches).items()})
    result["state_bytes"] = state_bytes
    if skipped is None:  # the push's reference: its bytes over a page-locked host-to-device copy's speed, this run
        from plexrl.bench.switch import memcpy_gbps

        result["vllm_push_copy_s"] = result["vllm_push_bytes"] / (memcpy_gbps(result["vllm_push_bytes"], 4,
                                                                               args.device, threads=args.threads) * 1e9)
        result["vllm_switch_in_vs_copy"] = result["vllm_switch_in_s"] / result["vllm_push_copy_s"]
    if skipped is not None:
        result["vllm_skipped"] = skipped
    elif "hf" in samplers:
        result["vllm_vs_hf"] = result["vllm_tokens_per_s"] / result["hf_tokens_per_s"]
    return result


def decode_figures(args, model: Path, folder: str) -> dict:
    """The sweep (on the bench's model) and the rollout A/B (on the demo's model): decode_sweep.py."""
    import torch

    from plexrl.bench import decode_sweep
    from plexrl.models.tiny import make_tiny_model
    from plexrl.runtime import precision as precisions
    from plexrl.runtime.state import load_module

    device = "cuda" if args.device == "cuda" else "cpu"
    dtype = precisions.state_dtypes(precisions.resolve(args.precision, args.device), False, None)[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        out = {"copy_bandwidth_gbps": decode_sweep.copy_bandwidth(device) / 1e9, "graph": device == "cuda"}
        if args.sweep:
            module = load_module(model).to(device=device, dtype=dtype)
            out["sweep"] = decode_sweep.sweep(module, device, args.sweep, args.prompt_tokens, args.max_tokens,
                                              args.repeats, out["graph"], out["copy_bandwidth_gbps"] * 1e9)
            at_batch = [row for row in out["sweep"] if row["batch"] == args.batch]  # gpu-check's figure
            if at_batch:
                out.update({key: at_batch[0][key] for key in ("batched_tokens_per_s", "bound_tokens_per_s",
                                                               "batched_of_bound")})
        if args.rollout:
            prompts, samples, tokens = args.rollout
            demo = load_module(make_tiny_model(f"{folder}/demo-model")).to(device=device, dtype=dtype)
            out.update(decode_sweep.rollout(demo, device, prompts, samples, args.prompt_tokens, tokens, out["graph"],
                                            args.repeats))
        return out
    finally:
        torch.set_num_threads(threads)


def batch_sizes(text: str) -> list[int]:
    sizes = [int(part) for part in text.split(",") if part.strip()]
    if any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}; expected comma-separated batch sizes >= 1, e.g. 1,8,64")
    return sizes


def rollout_shape(text: str) -> tuple[int, int, int] | None:
    if text in ("", "none"):
        return None
    try:
        shape = tuple(int(part) for part in text.split("x"))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}; expected PROMPTSxSAMPLESxTOKENS such as 64x8x32, or none")
    return shape


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="plexrl bench sample", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model-size", default="tiny", choices=sorted(PRESETS),
                        help="tiny: hidden 64, 2 layers; 1b: ~1.03B parameters (hidden 2048, 20 layers; GPU only)")
    parser.add_argument("--hidden", type=int, help="overrides the preset's")
    parser.add_argument("--layers", type=int, help="overrides the preset's")
    parser.add_argument("--heads", type=int, help="overrides the preset's (head_dim >= 32 for vLLM on CPU)")
    parser.add_argument("--intermediate", type=int, help="overrides the preset's MLP width")
    parser.add_argument("--samplers", default="hf,vllm", help="comma-separated, of hf and vllm")
    parser.add_argument("--batch", type=int, default=64, help="sequences per sample call")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per sequence")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed sample calls per sampler, after a warm-up")
    parser.add_argument("--switches", type=int, default=8, help="timed switches between the two vLLM states")
    parser.add_argument("--threads", type=int, default=1, help="a CPU device's threads (its vLLM engine's too)")
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                        help="of the states (auto: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--sweep", type=batch_sizes, default=batch_sizes("1,4,16,64,256"),
                        help="live batch sizes of the loop/batched/bound sweep ('' skips it)")
    parser.add_argument("--rollout", type=rollout_shape, default=rollout_shape("64x8x32"),
                        help="PROMPTSxSAMPLESxTOKENS of the rollout A/B on the demo's model, or none")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.samplers.split(",")) - set(SAMPLERS) - {""})
    if unknown or not args.samplers.strip(","):
        parser.error(f"--samplers {args.samplers!r}; expected a comma-separated list of {list(SAMPLERS)}")
    for name in ("batch", "max_tokens", "prompt_tokens", "repeats", "switches", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}; expected an integer >= 1")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is available; use cpu")
    emit("sample: decode tokens/s of batched sampling vs the loop and the memory-bound limit, vLLM vs HF, and a "
         "vLLM state's switch-in (wake + push) and switch-out", run(args), args.json, table)
    return 0
