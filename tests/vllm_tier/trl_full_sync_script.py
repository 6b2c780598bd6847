"""Three GRPO steps in colocate mode with TRL's own full-weight sync (no LoRA sync); prints the outcome as JSON.

Run in a fresh process by `test_vllm_full_sync.py`: vLLM's in-process engine initialises `torch.distributed`, so a
second engine cannot share the pytest process with the LoRA-sync run.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from vllm_helpers import agentic_config, build_calculator_policy, build_trainer, masked_logp_gaps

    model_dir, output_dir = sys.argv[1], sys.argv[2]
    build_calculator_policy(model_dir)
    trainer = build_trainer(model_dir, agentic_config(output_dir, "colocate", max_steps=3), lora_sync=False)
    outcome = {"lora_sync": getattr(trainer.vllm_generation, "lora_sync", False)}

    def linear_weight_sizes(model):  # runs inside the engine's worker
        return [p.numel() for n, p in model.named_parameters() if n.endswith(("qkv_proj.weight", "down_proj.weight"))]

    # vLLM's CPU backend may replace every linear layer's weight by an empty Parameter after loading (its GEMM
    # dispatch packs the weight for oneDNN / sgl-kernel / zentorch: `dispatch_cpu_unquantized_gemm(remove_weight=True)`
    # in vllm/model_executor/layers/utils.py). Recorded before training: what the engine holds decides the outcome.
    sizes = [size for worker in trainer.vllm_generation.llm.apply_model(linear_weight_sizes) for size in worker]
    outcome["linear_weights"] = len(sizes)
    outcome["engine_dropped_linear_weights"] = any(size == 0 for size in sizes)
    try:
        result = trainer.train()
        outcome["error"] = None
        outcome["global_step"] = result.global_step
        outcome["steps"] = [int(b["global_step"]) for b in trainer.recorded_batches]
        # The last batch was generated after two full syncs of a moved adapter: vLLM samples from the merged weights.
        outcome["policy_gap"], outcome["base_gap"] = masked_logp_gaps(trainer, trainer.recorded_batches[-1])
    except Exception as error:  # noqa: BLE001 - the error is the result
        outcome["error"] = {"type": type(error).__name__, "message": str(error)}
    print("RESULT " + json.dumps(outcome), flush=True)
