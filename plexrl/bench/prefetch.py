"""`plexrl bench prefetch`: how much of its switch-in time a device hides by loading the state it
will run next while the current function runs (scheduler.py, device_worker.py), against the same
run without prefetch, both in this run.

Two jobs take turns on one device. Each holds two frozen models of about SIZE bytes (a policy
snapshot and a reference model, as an RL job scoring its rollouts under both) and keeps both of
its compute_logprobs calls in flight, ROUNDS times. The arena holds two of the four states, so
about every other call is a switch: without prefetch each load waits in front of its function;
with it, the next state loads while the current one computes. Figures:
- `switch_in_s_per_call`: the load seconds each call waited for (prefetch off: every load;
  on: a prefetched load's part its function did not hide, and whole loads that were not prefetched);
- `hidden_fraction`: the part of the prefetch run's load seconds that overlapped a function,
  beside its bound `hidden_fraction_bound` = min(1, call time / load time) (a load can hide behind
  at most the function before it: with large states behind short calls the most there is to hide
  is small, and a fraction near it says the overlap works) and `hidden_of_bound`, their ratio;
- `makespan_s` of both runs, and `exec_s_per_call`: the function time there is to hide a load behind.
The target on GPU (issues #15, #57): a hidden fraction of at least half its bound.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from plexrl.bench.common import emit


def run(nbytes: int, rounds: int, tokens: int, device: str, prefetch: bool) -> dict:
    import plexrl
    from plexrl.bench.switch import model_shape
    from plexrl.engines.local import LocalCluster
    from plexrl.models.tiny import make_tiny_model, parameter_count
    from plexrl.runtime.activation import reserve_of

    with tempfile.TemporaryDirectory() as folder:
        width, layers = model_shape(nbytes)
        model = make_tiny_model(f"{folder}/model", hidden_size=width, num_layers=layers, num_heads=width // 64,
                                intermediate_size=round(2.75 * width))
        state_bytes = 4 * parameter_count(model)
        # the arena holds two of the four states beside the activation reserve, measured here as the
        # cluster will (on calls of this bench's size), whatever its size: half a state to spare
        reserve = reserve_of(str(model), tokens, device)
        with LocalCluster(devices=1, device_memory_bytes=reserve + state_bytes * 5 // 2, activation_probe_tokens=tokens,
                          host_memory_bytes=5 * state_bytes, torch_device=device, precision="fp32",
                          prefetch=prefetch, workdir=f"{folder}/cluster") as cluster:
            jobs = {job: [cluster.service_client(job).create_sampling_client(model, name=name)
                          for name in ("policy", "reference")] for job in ("a", "b")}
            ids = plexrl.ModelInput.from_ints([5 + i % 50 for i in range(tokens)])
            for states in jobs.values():  # first touch: the host copies' pages and the models' templates
                for client in states:
                    client.compute_logprobs(ids).result()
            skip = len(cluster.events())
            t0 = time.perf_counter()
            for _ in range(rounds):
                for future in [client.compute_logprobs(ids) for states in jobs.values() for client in states]:
                    future.result()
            makespan = time.perf_counter() - t0
            events = cluster.events()[skip:]
            budget = cluster.metrics()["device_budget"][0]
    if budget["state_bytes"] // state_bytes != 2:
        raise RuntimeError(f"the arena holds {budget['state_bytes']:,} bytes of states, not two of {state_bytes:,} "
                           f"(device budget {budget}); expected the reserve measured beforehand ({reserve:,}) "
                           "to be the cluster's")
    loads = [e for e in events if e["event"] == "transition" and e["kind"] == "load"]
    calls = [e for e in events if e["event"] == "end" and e.get("fn") == "compute_logprobs"]
    load_s = sum(e["seconds"] for e in loads)
    hidden_s = sum(e.get("hidden_s", 0.0) for e in loads)
    return {"calls": len(calls), "loads": len(loads), "prefetched": sum("hidden_s" in e for e in loads),
            "load_s": load_s, "switch_in_s": load_s - hidden_s, "hidden_s": hidden_s, "makespan_s": makespan,
            "exec_s": sum(e.get("device_s", 0.0) for e in calls), "state_bytes": state_bytes,
            "activation_reserve_bytes": budget["activation_reserve_bytes"]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="plexrl bench prefetch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=128, help="bytes per state, in MiB")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per compute_logprobs call")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is available; use cpu")
    off, on = (run(args.size_mb << 20, args.rounds, args.tokens, args.device, p) for p in (False, True))
    result = {"switch_in_s_per_call_off": off["switch_in_s"] / off["calls"],
              "switch_in_s_per_call_on": on["switch_in_s"] / on["calls"],
              "hidden_fraction": on["hidden_s"] / on["load_s"] if on["load_s"] else 0.0,
              "prefetched_loads": on["prefetched"], "loads_on": on["loads"], "loads_off": off["loads"],
              "makespan_s_off": off["makespan_s"], "makespan_s_on": on["makespan_s"],
              "exec_s_per_call": on["exec_s"] / on["calls"], "calls": on["calls"],
              "load_s_per_load": on["load_s"] / on["loads"] if on["loads"] else 0.0,
              "state_bytes": on["state_bytes"], "activation_reserve_bytes": on["activation_reserve_bytes"],
              "device": args.device}
    bound = min(1.0, result["exec_s_per_call"] / result["load_s_per_load"]) if result["load_s_per_load"] else 1.0
    result.update(hidden_fraction_bound=bound, hidden_of_bound=result["hidden_fraction"] / bound if bound else 0.0)
    emit("prefetch: switch-in time a device hides behind the running function (two jobs, four states, "
         "an arena of two)", result, args.json)
    return 0
