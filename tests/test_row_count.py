"""Which rows count (issue 35, item 5): one rule (`trl_agentic.batch.counted_rows`) for `num_rows_in_batch` and for
TracIn's row counts, so the same batch steps the same with TracIn selecting every row as without TracIn."""

import json
from types import SimpleNamespace

import torch
from datasets import Dataset

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.batch import counted_rows
from trl_agentic.errors import InfrastructureError
from trl_agentic.rollout.types import RowKind
from trl_agentic.tracin.trainer_mixin import TracInMixin


class DownOnceEnv:
    """The first call of the batch finds its service down (infrastructure, never retried here): that rollout is lost."""

    remaining = 1

    def reset(self, **kwargs):
        self.total = 0

    def work(self, x: int) -> str:
        """
        Do some work.

        Args:
            x: Input.
        """
        if DownOnceEnv.remaining > 0:
            DownOnceEnv.remaining -= 1
            raise InfrastructureError("the service refused the connection")
        self.total += x
        return str(self.total)


class Script:
    """One tool call, then an answer."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = []
        for ids in prompt_ids:
            if "<tool_response>" in self.tok.decode(ids):
                out.append("Done.<|im_end|>")
            else:
                out.append(
                    f"<tool_call>\n{json.dumps({'name': 'work', 'arguments': {'x': 2}})}\n</tool_call><|im_end|>"
                )
        return [self.tok.encode(s, add_special_tokens=False) for s in out], None


def reward(environments, **kwargs):
    return [float(env.total) + 0.1 * k for k, env in enumerate(environments)]


def test_a_rollout_lost_to_infrastructure_counts_in_no_row_count(tiny_model_dir, tiny_tokenizer, tmp_path):
    """009b255 counted the lost rollout in `num_rows_in_batch` (8) but not in TracIn's count of the same batch with
    every row selected (7): TracIn on stepped 8/7 larger. Both are 7 now (hand count: 8 rollouts, 1 lost)."""
    DownOnceEnv.remaining = 1
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=256,
        loss_type="grpo",
        save_strategy="no",
        max_tool_output_chars=1000,  # trl-agentic's loop (infrastructure errors are its own)
        max_infra_retries=0,
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"task {i}"}] for i in range(2)] * 4})
    trainer = AgenticGRPOTrainer(
        model=tiny_model_dir, reward_funcs=reward, args=args, train_dataset=dataset, environment_factory=DownOnceEnv
    )
    trainer._generate_single_turn = Script(tiny_tokenizer)
    trainer.model.train()
    rows = [dict(dataset[i]) for i in (0, 0, 0, 0, 1, 1, 1, 1)]  # as TRL's sampler repeats each prompt
    batch = trainer._generate_and_score_completions(rows)
    assert trainer._last_loop_result.infra_failed.count(True) == 1
    lost = trainer._last_loop_result.infra_failed.index(True)
    mask = batch["completion_mask"] * batch["tool_mask"]
    assert mask[lost].sum() == 0 and batch["row_kind"][lost] == RowKind.REGULAR
    assert int(batch["num_rows_in_batch"]) == 7
    # TracIn selecting every trainable row counts the same rows.
    selected = mask.sum(1) > 0
    assert int(trainer._tracin_selected_rows(selected, [batch])) == int(batch["num_rows_in_batch"])


def test_counted_rows_rule_on_a_hand_built_batch():
    """Trained row, a row TRL masked as truncated (counts, as in TRL's own row mean), a lost row, a padding row."""
    batch = {
        "prompt_ids": torch.zeros(4, 2, dtype=torch.long),
        "completion_mask": torch.tensor([[1, 1], [0, 0], [1, 1], [0, 0]]),
        "tool_mask": torch.tensor([[1, 1], [1, 1], [0, 0], [0, 0]]),
        "row_kind": torch.tensor([RowKind.REGULAR, RowKind.REGULAR, RowKind.REGULAR, RowKind.PADDING]),
        "counted_row": torch.tensor([True, True, False, False]),
    }
    assert counted_rows(batch).tolist() == [True, True, False, False]
    stub = SimpleNamespace(accelerator=SimpleNamespace(gather=lambda x: x))
    # TracIn leaves out the trained row: only the truncated one is still counted.
    left_out = TracInMixin._tracin_selected_rows(stub, torch.tensor([False, False, False, False]), [batch])
    kept = TracInMixin._tracin_selected_rows(stub, torch.tensor([True, False, False, False]), [batch])
    assert (int(left_out), int(kept)) == (1, 2)
    # A batch TRL built (no trl-agentic keys): every row counts.
    assert counted_rows({"prompt_ids": torch.zeros(3, 1)}).tolist() == [True, True, True]
