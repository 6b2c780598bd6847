"""Guard: every private GRPOTrainer hook we override or call keeps the signature and contract we were written for.

TRL gives no stability promise for these methods; if this test fails after a TRL upgrade, re-read the new code before
changing the expected strings.
"""

import inspect

import pytest
import trl
from trl import GRPOTrainer

EXPECTED = {
    # overridden
    "_tool_call_loop": "(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields)",
    "_calculate_rewards": "(self, inputs, prompts, completions, completion_ids_list)",
    "_generate_and_score_completions": "(self, inputs: list[dict[str, torch.Tensor | typing.Any]]) -> dict[str, torch.Tensor | typing.Any]",
    "_save_checkpoint": "(self, model, trial)",
    # _compute_loss is overridden too (listed below with the called ones)
    "_load_optimizer_and_scheduler": "(self, checkpoint)",
    # called
    "_generate_single_turn": "(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False)",
    "_get_tool_suffix_ids": "(self, tool_messages)",
    "_generate": "(self, prompts: list)",
    "_compute_loss": "(self, model, inputs)",
    "_prepare_inputs": "(self, generation_batch: dict[str, torch.Tensor | typing.Any]) -> dict[str, torch.Tensor | typing.Any]",
}


def test_trl_version_is_pinned():
    assert trl.__version__ == "1.16.0"


def test_private_signatures_unchanged():
    actual = {name: str(inspect.signature(getattr(GRPOTrainer, name))) for name in EXPECTED}
    assert actual == EXPECTED
    params = inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters
    assert list(params)[:6] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size"]


def test_tool_loop_contract_unchanged():
    """`_generate` hands its `prompt_ids` list to the loop and returns that same list (snapshots rely on it), and the
    loop returns the 7-tuple we produce."""
    generate = inspect.getsource(GRPOTrainer._generate)
    assert "prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields" in generate
    assert (
        "return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images"
        in generate
    )
    loop = inspect.getsource(GRPOTrainer._tool_call_loop)
    assert (
        "return tool_mask, completions, completion_ids, logprobs, tool_call_count, tool_failure_count, tool_images"
        in loop
    )
    scoring = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    # The batch augmentation re-derives the rewards exactly like this and relies on these output keys.
    assert "rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)" in scoring
    assert "rewards_per_func = self._calculate_rewards(inputs, prompts, completions, completion_ids_list)" in scoring
    assert '"num_items_in_batch": num_items_in_batch' in scoring
    assert "vllm_importance_sampling_ratio = torch.exp(logps_diff)" in scoring


def test_trl_deprecation_warnings_fail_the_suite(tmp_path):
    """pyproject's `filterwarnings` turns a deprecation that TRL issues into an error, whether it is attributed to a
    TRL module, to trl-agentic's code (TRL warns with `stacklevel=2`, at our call site: how it would deprecate a
    method we override) or to a test; other libraries' deprecations stay quiet."""
    import warnings

    from trl import GRPOConfig

    from trl_agentic import AgenticGRPOConfig

    values = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, use_transformers_paged=True)
    with pytest.raises(FutureWarning, match="use_transformers_paged"):
        GRPOConfig(**values)  # attributed to this test module
    with pytest.raises(FutureWarning, match="use_transformers_paged"):
        AgenticGRPOConfig(**values)  # attributed to trl_agentic.config
    for module in ("trl.trainer.grpo_trainer", "trl_agentic.trainer"):
        with pytest.raises(DeprecationWarning):
            warnings.warn_explicit("deprecated", DeprecationWarning, "x.py", 1, module=module)
    warnings.warn_explicit("deprecated", DeprecationWarning, "x.py", 1, module="transformers.utils")  # quiet


@pytest.mark.parametrize("which", ["sync", "async"])
def test_trainers_take_trls_parameters_in_trls_order(which):
    """A drop-in subclass: every parameter of TRL's trainer, in TRL's order with TRL's defaults (positional calls such
    as `GRPOTrainer(model, reward_funcs, args, dataset)` work unchanged); ours only after them, keyword-only."""
    if which == "sync":
        from trl_agentic import AgenticGRPOTrainer as ours

        theirs = GRPOTrainer
    else:
        from trl.experimental.async_grpo import AsyncGRPOTrainer as theirs

        from trl_agentic.async_grpo import AsyncAgenticGRPOTrainer as ours
    expected = [(p.name, p.kind, p.default) for p in inspect.signature(theirs.__init__).parameters.values()]
    params = list(inspect.signature(ours.__init__).parameters.values())
    assert [(p.name, p.kind, p.default) for p in params[: len(expected)]] == expected
    assert [(p.name, p.kind) for p in params[len(expected) :]] == [
        ("advantage_estimator", inspect.Parameter.KEYWORD_ONLY),
        ("tracin_eval_dataset", inspect.Parameter.KEYWORD_ONLY),
    ]


def test_a_positional_train_dataset_reaches_the_trainer(tiny_model_dir, tmp_path):
    from datasets import Dataset

    from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer

    args = AgenticGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    dataset = Dataset.from_dict({"prompt": ["Say hi."] * 8})
    trainer = AgenticGRPOTrainer(tiny_model_dir, lambda completions, **kw: [0.0] * len(completions), args, dataset)
    assert trainer.train_dataset is dataset
