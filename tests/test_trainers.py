"""fxoffload under the training loops people use: Hugging Face Trainer, Accelerate, PEFT LoRA and a plain
loop with ``torch.autocast``. Each trains a tiny Llama (random weights, no download) on CPU with
``offload_cpu=True`` and must give the losses of the same compiler without fxoffload, with something
offloaded. The recipes are the ones in docs/user-guide.md ("Trainers")."""

import tempfile

import pytest
import torch

from .conftest import cpu_backend

MISSING = "{} is not installed (pip install -c constraints.txt -e '.[test]')"
transformers = pytest.importorskip("transformers", reason=MISSING.format("transformers"))
accelerate = pytest.importorskip("accelerate", reason=MISSING.format("accelerate"))
peft = pytest.importorskip("peft", reason=MISSING.format("peft"))
safetensors_torch = pytest.importorskip("safetensors.torch", reason=MISSING.format("safetensors"))

VOCAB, SEQ, BATCH, STEPS = 128, 16, 2, 3


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    # Accelerator() state is process-wide and the first one wins: a later Accelerator(dynamo_plugin=...)
    # would silently keep the earlier one's plugin. accelerate's own tests reset it the same way.
    yield
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerate.state.GradientState._reset_state()


def llama():
    """One layer, seeded: every call builds the same weights, so runs compare without a deepcopy."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).train()


def token_ids():
    return torch.randint(0, VOCAB, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def batches():
    return [{"input_ids": x, "labels": x} for x in token_ids().view(STEPS, BATCH, SEQ)]


def offloaded(backend) -> int:
    (report,) = backend.reports  # one graph: no graph break, no recompile
    return len(report.offloaded)


def trainer(model, out, remove_unused_columns=False):
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=BATCH, max_steps=STEPS, logging_steps=1,
        learning_rate=1e-3, seed=0, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
        torch_compile=False, remove_unused_columns=remove_unused_columns,
    )  # fmt: skip
    rows = [{"input_ids": x, "labels": x} for x in token_ids()]
    return transformers.Trainer(model=model, args=args, train_dataset=rows)


def train_with_trainer(backend, remove_unused_columns=False):
    with tempfile.TemporaryDirectory() as out:
        hf_trainer = trainer(torch.compile(llama(), backend=backend), out, remove_unused_columns)
        hf_trainer.train()
    return torch.tensor([log["loss"] for log in hf_trainer.state.log_history if "loss" in log])


def test_hf_trainer_gives_inductor_losses():
    backend = cpu_backend()  # inner="inductor"
    got = train_with_trainer(backend)
    torch._dynamo.reset()
    reference = train_with_trainer("inductor")
    assert len(got) == STEPS
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
    assert offloaded(backend) >= 5


def test_hf_trainer_drops_every_column_of_a_compiled_model_unless_told_not_to():
    # The compiled module's forward is (*args, **kwargs): Trainer finds no named input to keep.
    with pytest.raises(ValueError, match="batch received was empty.*args,kwargs"):
        train_with_trainer("eager", remove_unused_columns=True)


def test_hf_trainer_saves_a_compiled_model_under_prefixed_keys(tmp_path):
    # Trainer.save_model takes the state dict of the module it was given: the compiled wrapper's keys
    # start with "_orig_mod.", which from_pretrained does not recognise. Saving the module that was
    # compiled writes the usual keys.
    model = llama()
    hf_trainer = trainer(torch.compile(model, backend="eager"), tmp_path / "run")
    hf_trainer.train()
    hf_trainer.save_model(tmp_path / "trainer")
    keys = safetensors_torch.load_file(tmp_path / "trainer" / "model.safetensors").keys()
    assert keys and all(k.startswith("_orig_mod.") for k in keys), sorted(keys)
    model.save_pretrained(tmp_path / "model")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "model")
    trained = model.state_dict()
    assert loaded.state_dict().keys() == trained.keys()
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0, msg=name)


def test_hf_trainer_rejects_the_backend_name():
    # TrainingArguments accepts any name; Trainer hands it to accelerate, whose DynamoBackend enum lists
    # only the backends accelerate knows, so the failure comes before anything compiles.
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, torch_compile_backend="fxoffload", report_to=[])
        assert args.torch_compile
        with pytest.raises(ValueError, match="'FXOFFLOAD' is not a valid DynamoBackend"):
            transformers.Trainer(model=llama(), args=args, train_dataset=[])


def train_with_accelerate(model, **accelerator_kwargs):
    accelerator = accelerate.Accelerator(cpu=True, **accelerator_kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for batch in batches():
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return model, torch.stack(losses)


def test_accelerate_keeps_a_model_compiled_with_fxoffload():
    backend = cpu_backend(inner="aot_eager")
    compiled = torch.compile(llama(), backend=backend)
    prepared, got = train_with_accelerate(compiled)
    assert prepared is compiled  # prepare() sees a compiled module and does not compile it again
    torch._dynamo.reset()
    # accelerate's own compile path, which takes backend names from its list only
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    plugin = accelerate.utils.TorchDynamoPlugin(backend="aot_eager")
    reference_model, reference = train_with_accelerate(llama(), dynamo_plugin=plugin)
    assert accelerate.utils.is_compiled_module(reference_model)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
    assert offloaded(backend) >= 5
    with pytest.raises(ValueError, match="'FXOFFLOAD' is not a valid DynamoBackend"):
        accelerate.utils.TorchDynamoPlugin(backend="fxoffload")


def train_lora(backend):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(llama(), config)
    step = model if backend is None else torch.compile(model, backend=backend)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for batch in batches():
        optimizer.zero_grad(set_to_none=True)
        loss = step(**batch).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses), grads


def test_peft_lora_trains_only_the_adapters():
    backend = cpu_backend(inner="aot_eager")
    losses, grads = train_lora(backend)
    torch._dynamo.reset()
    ref_losses, ref_grads = train_lora("aot_eager")
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
    # r=4 adapters on q and v of one layer: lora_A and lora_B for each, nothing of the base model
    assert len(grads) == 4 and all(".lora_A." in n or ".lora_B." in n for n in grads), sorted(grads)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(losses, train_lora(None)[0], rtol=1e-5, atol=1e-5)  # eager
    assert losses[-1] < losses[0]
    assert offloaded(backend) >= 5


def train_autocast(backend):
    model = llama()
    step = model if backend is None else torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-1)
    losses = []
    for batch in batches():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = step(**batch).loss
        loss.backward()  # outside autocast, as torch.amp recommends
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def test_autocast_bf16_loop_gives_the_losses_of_the_same_compiler():
    backend = cpu_backend(inner="aot_eager")
    got = train_autocast(backend)
    torch._dynamo.reset()
    reference = train_autocast("aot_eager")
    # Same compiler, same bf16 ops: moving tensors to the host and back changes no bit.
    torch.testing.assert_close(got, reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, train_autocast(None), rtol=1.6e-2, atol=1e-5)  # eager: bf16's resolution
    (report,) = backend.reports
    assert len(report.offloaded) >= 5
    assert {row.dtype for row in report.offloaded} >= {"bfloat16"}, report.table()
