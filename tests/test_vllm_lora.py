"""`trl_agentic.vllm_lora` without vLLM: adapter export, the fallback rules, and the TRL code the sync hooks into.

The sync itself (colocate and server) is tested with vLLM in `tests/vllm_tier` (`make test-vllm`).
"""

import inspect
import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from trl_agentic.vllm_lora import (
    LoRASyncVLLMGeneration,
    adapter_state_dict,
    lora_server_command,
    lora_sync_unsupported_reason,
    lora_sync_vllm,
    save_adapter,
    vllm_max_lora_rank,
)


def _peft(tiny_model_dir, **overrides):
    values = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    values.update(overrides)
    return get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(**values))


def test_max_lora_rank_is_rounded_up_to_a_value_vllm_accepts():
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 16, 200, 300, 512)] == [1, 8, 8, 16, 16, 256, 320, 512]
    with pytest.raises(ValueError, match="above vLLM's largest"):
        vllm_max_lora_rank(513)


def _unfreeze_a_base_weight(model):
    model.get_base_model().model.norm.weight.requires_grad_(True)
    return model


def _with_init(value):
    def modify(model):
        model.peft_config["default"].init_lora_weights = value
        return model

    return modify


# Every adapter setting the LoRA sync has to decide on: served as a vLLM LoRA adapter (None), or the reason it is
# not (then TRL's full sync on GPU; refused at start-up on vLLM's CPU backend, where that sync cannot run).
SYNC_TABLE = [
    ("plain LoRA", {}, None, None),
    ("rank rounded up (r=4 -> 8)", {"r": 4}, None, None),
    ("rank 512", {"r": 512}, None, None),
    ("rank above 512", {"r": 520}, "above vLLM's largest", None),
    ("rsLoRA", {"use_rslora": True}, None, None),
    ("some layers only", {"layers_to_transform": [0]}, None, None),
    ("DoRA", {"use_dora": True}, "DoRA", None),
    ("modules_to_save", {"modules_to_save": ["lm_head"]}, "modules_to_save", None),
    ("bias='all'", {"bias": "all"}, "biases", None),
    ("bias='lora_only'", {"bias": "lora_only"}, "biases", None),
    ("lora_bias", {"lora_bias": True}, "biases", None),
    ("rank_pattern", {"rank_pattern": {"q_proj": 2}}, "rank_pattern", None),
    ("alpha_pattern", {"alpha_pattern": {"q_proj": 2}}, "rank_pattern", None),
    ("trainable_token_indices", {"trainable_token_indices": [1, 2]}, "trainable_token_indices", None),
    ("LoRA on embeddings", {"target_modules": ["q_proj", "embed_tokens"]}, "embeddings or the LM head", None),
    ("LoRA on lm_head", {"target_modules": ["q_proj", "lm_head"]}, "embeddings or the LM head", None),
    ("base weight unfrozen by hand", {}, "outside the adapter are trainable", _unfreeze_a_base_weight),
    # Initialisations that rewrite the base weights (W - s * B @ A): vLLM serves the checkpoint's W plus the adapter.
    ("PiSSA", {"init_lora_weights": "pissa"}, "init_lora_weights='pissa'", None),
    ("PiSSA, fast SVD", {"init_lora_weights": "pissa_niter_4"}, "init_lora_weights='pissa_niter_4'", None),
    ("OLoRA", {"init_lora_weights": "olora"}, "init_lora_weights='olora'", None),
    # These need calibration data or a quantizer to build: only their config is set (what the check reads).
    ("CorDA", {}, "init_lora_weights='corda'", _with_init("corda")),
    ("LoftQ", {}, "init_lora_weights='loftq'", _with_init("loftq")),
    ("LoRA-GA", {}, "init_lora_weights='lora_ga'", _with_init("lora_ga")),
    # Initialisations of the adapter alone: the base weights stay the checkpoint's.
    ("gaussian init", {"init_lora_weights": "gaussian"}, None, None),
    ("orthogonal init", {"init_lora_weights": "orthogonal"}, None, None),
    ("EVA init", {"init_lora_weights": "eva"}, None, None),
    ("layer_replication", {"layer_replication": [[0, 2], [1, 2]]}, "layer_replication", None),
    # Variants vLLM's `PEFTHelper` drops silently: activated LoRA acts from its invocation tokens on only.
    ("activated LoRA", {"alora_invocation_tokens": [5, 6]}, "activated LoRA", None),
    ("KaSA", {"kasa_config": {}}, "kasa_config", None),
]


@pytest.mark.parametrize(("setting", "overrides", "reason", "modify"), SYNC_TABLE, ids=[r[0] for r in SYNC_TABLE])
def test_lora_sync_table(tiny_model_dir, setting, overrides, reason, modify):
    from trl_agentic.vllm_lora import lora_sync_decision

    policy = _peft(tiny_model_dir, **overrides)
    if modify is not None:
        policy = modify(policy)
    found = lora_sync_unsupported_reason(policy)
    if reason is None:
        assert found is None, found
        assert lora_sync_decision(policy, sleep_mode=False, on_cpu=True) is None
        assert "sleep mode" in lora_sync_decision(policy, sleep_mode=True, on_cpu=False)
        return
    assert found is not None and reason in found, found
    if setting == "activated LoRA":  # no merge expresses it: refused on every backend
        for on_cpu in (False, True):
            with pytest.raises(ValueError, match="would act on every token too"):
                lora_sync_decision(policy, sleep_mode=False, on_cpu=on_cpu)
        return
    # GPU: TRL's full sync (merge and push every weight) serves it exactly, with a warning at start-up.
    assert reason in lora_sync_decision(policy, sleep_mode=False, on_cpu=False)
    # vLLM's CPU backend: that fallback cannot run, so the set-up is refused before any engine starts.
    with pytest.raises(ValueError, match="does not run on vLLM's CPU backend") as error:
        lora_sync_decision(policy, sleep_mode=False, on_cpu=True)
    assert reason in str(error.value)


@pytest.mark.parametrize(
    "init", [True, False, "gaussian", "orthogonal", "eva", "mica", "pissa", "pissa_niter_4", "olora"]
)
def test_inits_refused_are_those_that_rewrite_the_base_weights(tiny_model_dir, init):
    # vLLM serves the checkpoint's weights plus the adapter: right only if the policy's base weights are the
    # checkpoint's. Compared weight by weight here, independently of the rule in `lora_sync_unsupported_reason`.
    checkpoint = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    policy = _peft(tiny_model_dir, init_lora_weights=init)
    base = {
        name.removeprefix("base_model.model.").replace(".base_layer.", "."): tensor
        for name, tensor in policy.state_dict().items()
        if "lora_" not in name
    }
    assert base.keys() == checkpoint.keys()
    rewritten = [name for name in checkpoint if not torch.equal(base[name], checkpoint[name])]
    reason = lora_sync_unsupported_reason(policy)
    assert bool(rewritten) == (reason is not None), (rewritten, reason)
    if rewritten:
        assert "init_lora_weights" in reason


def test_layer_replication_gives_the_policy_layers_the_checkpoint_lacks(tiny_model_dir):
    policy = _peft(tiny_model_dir, layer_replication=[[0, 2], [1, 2]])
    checkpoint = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert len(policy.get_base_model().model.layers) == 3 != len(checkpoint.model.layers)
    assert "layer_replication" in lora_sync_unsupported_reason(policy)


def test_other_peft_types_and_plain_models_are_not_served_as_lora(tiny_model_dir):
    from peft import IA3Config

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert lora_sync_unsupported_reason(plain) == "the model is not a PEFT model"
    ia3 = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]),
    )
    assert "IA3" in lora_sync_unsupported_reason(ia3)


def test_adapter_is_exported_in_the_engine_dtype(tiny_model_dir):
    policy = _peft(tiny_model_dir)
    state32 = adapter_state_dict(policy)
    state16 = adapter_state_dict(policy, dtype=torch.bfloat16)
    assert {t.dtype for t in state32.values()} == {torch.float32}
    assert {t.dtype for t in state16.values()} == {torch.bfloat16}
    for name, tensor in state32.items():
        torch.testing.assert_close(state16[name], tensor.to(torch.bfloat16), rtol=0, atol=0)
    # Half the bytes on the way to a bfloat16 engine, which casts the adapter to bfloat16 when it loads it anyway.
    assert sum(t.nbytes for t in state16.values()) * 2 == sum(t.nbytes for t in state32.values())


def test_saved_adapter_reloads_into_the_same_policy(tiny_model_dir, tmp_path):
    policy = _peft(tiny_model_dir)
    state = adapter_state_dict(policy)
    assert state and all(t.device.type == "cpu" and t.is_contiguous() for t in state.values())
    # The names PEFT (and vLLM's LoRA loader) expect: no adapter name inside.
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in state)
    assert not any(".default." in k for k in state)
    folder = save_adapter(policy, str(tmp_path / "adapter"), state)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), folder)
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, policy(ids).logits)
        with policy.disable_adapter():
            base = policy(ids).logits
    assert not torch.allclose(base, policy(ids).logits)  # the adapter is not a no-op, so the check above means much


def test_exported_state_is_a_copy(tiny_model_dir):
    policy = _peft(tiny_model_dir)
    state = adapter_state_dict(policy)
    name, tensor = next(iter(state.items()))
    before = tensor.clone()
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(1.0)
    torch.testing.assert_close(state[name], before)


def test_lora_sync_vllm_swaps_the_class_grpo_trainer_builds_only_inside():
    import trl.trainer.grpo_trainer as grpo_module

    original = grpo_module.VLLMGeneration
    with lora_sync_vllm(True, sync_dir="/some/dir"):
        factory = grpo_module.VLLMGeneration
        assert factory.func is LoRASyncVLLMGeneration and factory.keywords == {
            "lora_sync": True,
            "sync_dir": "/some/dir",
        }
    assert grpo_module.VLLMGeneration is original
    with lora_sync_vllm(False):
        assert grpo_module.VLLMGeneration is original
    with pytest.raises(RuntimeError), lora_sync_vllm(True):
        raise RuntimeError("restored even on errors")
    assert grpo_module.VLLMGeneration is original


def test_server_command_has_trls_flags_and_lora():
    argv, env = lora_server_command("/models/policy", max_lora_rank=12, port=8123, extra_args=["--enforce-eager"])
    assert argv[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/models/policy"]
    joined = " ".join(argv)
    assert "--logprobs-mode processed_logprobs" in joined and "--max-logprobs -1" in joined
    assert "--enable-lora --max-lora-rank 16" in joined and "--port 8123" in joined and argv[-1] == "--enforce-eager"
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}


# -- TRL drift guards: the LoRA sync reuses TRL code through these exact hooks (trl==1.16.0 is pinned) -------------


def test_grpo_trainer_builds_vllm_generation_from_its_module_global():
    from trl import GRPOTrainer

    source = inspect.getsource(GRPOTrainer.__init__)
    assert "self.vllm_generation = VLLMGeneration(" in source  # looked up in trl.trainer.grpo_trainer at call time
    single_turn = inspect.getsource(GRPOTrainer._generate_single_turn)
    assert "self.vllm_generation.sync_weights()" in single_turn and "self.vllm_generation.generate(" in single_turn


def test_vllm_generation_hooks_are_where_the_lora_sync_expects_them():
    from trl.generation.vllm_generation import VLLMGeneration

    init = inspect.getsource(VLLMGeneration._init_vllm)
    # Colocate: `LLM` is read from the module at call time (so `_llm_kwargs` can add LoRA arguments) ...
    assert "self.llm = LLM(" in init and "model=model.name_or_path" in init
    # ... and server: the client and its NCCL group are created here (replaced by `_init_server`).
    assert "self.vllm_client = VLLMClient(" in init and "init_communicator(" in init
    generate = inspect.getsource(VLLMGeneration.generate)
    # Colocate generation goes through `self.llm.generate` (wrapped to add the LoRA request) ...
    assert "self.llm.generate(vllm_prompts, sampling_params=sampling_params, use_tqdm=False)" in generate
    # ... and server generation through the client, whose requests name `self.model` (set to the adapter's name).
    assert "self.vllm_client.generate(" in generate
    from trl.generation.vllm_client import VLLMClient

    assert '"model": self.model,' in inspect.getsource(VLLMClient.generate)
    assert set(inspect.signature(LoRASyncVLLMGeneration.__init__).parameters) >= {"lora_sync", "sync_dir"}


def _server_generation(policy, sync_dir, process_index=0):
    """A server-mode `LoRASyncVLLMGeneration` without a server (nor vLLM: `LoRARequest` is stubbed)."""
    from types import SimpleNamespace

    generation = object.__new__(LoRASyncVLLMGeneration)
    accelerator = SimpleNamespace(is_main_process=process_index == 0, process_index=process_index)
    generation.__dict__.update(
        model=policy,
        accelerator=accelerator,
        mode="server",
        _dist=None,
        lora_request=None,
        sync_history=[],
        lora_sync=True,
        _sync_dir_arg=str(sync_dir),
        adapter_dtype=torch.float32,
    )
    generation._load_on_server = lambda name, path, previous: None
    generation._lora_request = lambda name, int_id, path: SimpleNamespace(
        lora_name=name, lora_int_id=int_id, lora_path=path
    )
    generation._setup_sync_dir()
    return generation


def test_each_run_has_its_own_adapter_names_and_folders(tiny_model_dir, tmp_path):
    # Two runs against one long-lived server and one `TRL_AGENTIC_VLLM_LORA_DIR` (a restart, a resume, two trainers
    # of a script): the same name would be refused by the server ("already been loaded"), and the same name + path
    # are vLLM's prefix-cache keys, so KV blocks of the first run's adapter would be reused.
    policy = _peft(tiny_model_dir)
    first, second = (_server_generation(policy, tmp_path) for _ in range(2))
    for generation in (first, second):
        generation.sync_weights()
        generation.sync_weights()
    names = [r.lora_name for g in (first, second) for r in g.sync_history]
    paths = [r.path for g in (first, second) for r in g.sync_history]
    assert len(set(names)) == len(set(paths)) == 4, names
    assert all(name.startswith("trl-agentic-lora-") for name in names)
    assert first.lora_request.lora_path != second.lora_request.lora_path


def test_all_processes_use_the_main_processs_run_tag(tiny_model_dir, tmp_path, monkeypatch):
    # Colocated tensor-parallel engines must be handed the same adapter name on every rank: the tag is drawn on the
    # main process and broadcast (here the broadcast hands the other "rank" what rank 0 sent).
    import trl_agentic.vllm_lora as vllm_lora

    sent = []

    def broadcast(objects, from_process=0):
        if not sent:
            sent.extend(objects)
        objects[:] = sent
        return objects

    monkeypatch.setattr(vllm_lora, "broadcast_object_list", broadcast)
    policy = _peft(tiny_model_dir)
    main, other = _server_generation(policy, tmp_path, 0), _server_generation(policy, tmp_path, 1)
    assert sent[0] is not None and main.run_tag == other.run_tag == sent[0]
    main.sync_weights(), other.sync_weights()
    assert main.lora_request.lora_name == other.lora_request.lora_name


@pytest.mark.parametrize("client_reports", [True, False])
def test_server_mode_budgets_contexts_with_the_servers_max_model_len(client_reports):
    # The synchronous trainer's rollout loop keeps every context below the engine's length. In server mode that is the
    # server's --max-model-len (here 1100, as read from its /v1/models), not the model config's 4096; a client that
    # cannot tell (no `/v1/models` reader) leaves the config's.
    from types import SimpleNamespace

    from trl_agentic.rollout.trl_backend import TrainerBackend

    urls = []

    class Client:
        base_url = "http://vllm:8000"

        def _get(self, url, **kwargs):
            urls.append(url)
            return {"data": [{"id": "policy", "max_model_len": 1100}]}

    client = Client() if client_reports else SimpleNamespace()
    accelerator = SimpleNamespace(num_processes=1, is_main_process=True, process_index=0)
    trainer = SimpleNamespace(
        _tokenizer=SimpleNamespace(pad_token_id=0),
        max_completion_length=64,
        use_vllm=True,
        vllm_mode="server",
        vllm_generation=SimpleNamespace(vllm_client=client),
        _is_vlm=False,
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=4096)),
        max_tool_calling_iterations=4,
        accelerator=accelerator,
        eos_token_ids=[2],
    )
    assert TrainerBackend(trainer).max_model_len == (1100 if client_reports else 4096)
    assert TrainerBackend(trainer).max_model_len == (1100 if client_reports else 4096)  # the next rollout's
    assert urls == (["http://vllm:8000/v1/models"] if client_reports else [])  # read once per trainer


def test_a_server_that_cannot_tell_its_length_leaves_the_config_length(caplog):
    """A failed `/v1/models` read (a 503, a timeout) is a warning and the model config's length, not an error out of the
    training step (on several processes, the main one raised before the broadcast the others waited in)."""
    import logging
    from types import SimpleNamespace

    from trl_agentic.rollout.trl_backend import TrainerBackend

    class Client:
        base_url = "http://vllm:8000"

        def _get(self, url, **kwargs):
            assert kwargs.get("timeout")  # never waits forever
            raise Exception("Request failed: 503, Service Unavailable")

    trainer = SimpleNamespace(
        _tokenizer=SimpleNamespace(pad_token_id=0),
        max_completion_length=64,
        use_vllm=True,
        vllm_mode="server",
        vllm_generation=SimpleNamespace(vllm_client=Client()),
        _is_vlm=False,
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=4096)),
        max_tool_calling_iterations=4,
        accelerator=SimpleNamespace(num_processes=1, is_main_process=True, process_index=0),
        eos_token_ids=[2],
    )
    with caplog.at_level(logging.WARNING, logger="trl_agentic.rollout.trl_backend"):
        assert TrainerBackend(trainer).max_model_len == 4096
    assert "Could not read the vLLM server's max_model_len (Exception: Request failed: 503" in caplog.text


@pytest.mark.parametrize("lora_sync", [True, False])
def test_an_activated_lora_is_refused_with_vllm_before_the_model_loads(tmp_path, monkeypatch, lora_sync):
    """With `vllm_lora_sync=False` the activated LoRA reached TRL's full sync, merged and applied to every token."""
    from peft import LoraConfig

    import trl_agentic.models
    from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was loaded before the check")

    monkeypatch.setattr(trl_agentic.models, "resolve_model_path", forbidden)
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", use_vllm=True, vllm_lora_sync=lora_sync
    )
    peft_config = LoraConfig(r=4, target_modules=["q_proj"], alora_invocation_tokens=[5, 6], task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match="activated LoRA"):
        AgenticGRPOTrainer(
            model="unused", reward_funcs=lambda completions, **k: [0.0], args=args, peft_config=peft_config
        )
    # Without vLLM the policy generates itself, with the activated LoRA as PEFT applies it.
    plain = AgenticGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(AssertionError, match="a model was loaded"):
        AgenticGRPOTrainer(
            model="unused", reward_funcs=lambda completions, **k: [0.0], args=plain, peft_config=peft_config
        )
