"""harvest's layer-split LoRA trainer on the decode model's own frozen weights
(same-base-model mode: nothing copied, nothing swapped), built without LlamaFactory from
synthetic token batches: the trainer the GPU co-location experiment runs beside the
transformers decode engine. torch and peft are imported by the function.
"""

from __future__ import annotations


def build_shared_trainer(decode_model, device, *, lora_rank=16, seq_len=512, samples_per_step=4, micro_batch=2, seed=0,
                         compile_layers="auto", unit_sizing=None, compile_pairs=None):
    """harvest's LayerSplitTrainer for LoRA on ``decode_model``'s own frozen weights (no
    copy), built without LlamaFactory; synthetic batches of ``seq_len`` random tokens.
    ``micro_batch`` None: measured so a unit takes ``unit_sizing``'s target
    (harvest.train.microbatch; None: the stand-alone default). ``compile_pairs``:
    harvest.train.compiled_units.compile_layers' ``pairs``."""
    import torch
    from peft import LoraConfig, get_peft_model

    from harvest.train.build import TrainerSettings, assemble_trainer
    from harvest.train.job import HarvestOptions
    from harvest.train.weights import SharedTensorWeightSource

    config, dtype = decode_model.config, decode_model.dtype
    with torch.device("meta"):  # frozen weights come from the decode model: no second copy
        base = type(decode_model)(config)
    base = base.to(dtype).requires_grad_(False)
    base.model.rotary_emb = type(decode_model.model.rotary_emb)(config=config)  # real inv_freq buffers
    lora = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    peft_model = get_peft_model(base, lora)
    generator = torch.Generator().manual_seed(seed)
    for module in peft_model.modules():  # LoRA weights (on meta like their base layers) made real
        for name, param in list(module._parameters.items()):
            if param is not None and param.requires_grad:  # fp32 as LlamaFactory keeps them; B non-zero so A learns
                module._parameters[name] = torch.nn.Parameter(torch.randn(param.shape, generator=generator) * 0.02)
    tokens = torch.randint(0, config.vocab_size, (16 * samples_per_step, seq_len), generator=generator)
    dataset = [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row} for row in tokens]

    def collate(features):
        return {key: torch.stack([f[key] for f in features]) for key in ("input_ids", "attention_mask", "labels")}

    on_gpu = torch.device(device).type == "cuda"
    settings = TrainerSettings(samples_per_step=samples_per_step, learning_rate=1e-4, seed=seed, max_steps=10**9,
                               fused_adamw=on_gpu, autocast_dtype=dtype if dtype == torch.bfloat16 else None)
    shared = SharedTensorWeightSource(dict(decode_model.state_dict()))
    return assemble_trainer(peft_model, dataset, collate, settings, HarvestOptions(micro_batch_size=micro_batch),
                            device=torch.device(device), weight_source=shared,
                            compile_layers=compile_layers, unit_sizing=unit_sizing, compile_pairs=compile_pairs)
