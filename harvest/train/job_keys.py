"""The fate of every LlamaFactory training argument in a harvest job: honoured, refused or noted.

Each key of LlamaFactory 0.9.5's argument dataclasses (``_TRAIN_ARGS``) has exactly one
fate in `KEY_FATES`: **honoured** (done as ``llamafactory-cli train`` does; value checks in
`harvest.train.job`, naming the key), **refused** (a value other than the default stops the
job before anything loads, with the reason) or **noted** (it cannot change what is trained
here; a non-default value is accepted with a note saying why). Nothing is ignored
silently: ``tests/train/test_job_keys.py`` fails on any key without a fate, and the table
in ``docs/jobs.md`` is generated from `KEY_FATES` (``python -m harvest.train.job_keys``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Iterable, Mapping


class Fate(str, enum.Enum):
    HONOURED = "honoured"
    REFUSED = "refused"
    NOTED = "noted"


@dataclasses.dataclass(frozen=True)
class KeyFate:
    fate: Fate
    reason: str


KEY_FATES: dict[str, KeyFate] = {}


def _decide(fate: Fate, reason: str, keys: str) -> None:
    for key in keys.split():
        if key in KEY_FATES:
            raise AssertionError(f"job key {key!r} has two fates")  # a slip in this table, caught at import
        KEY_FATES[key] = KeyFate(fate, reason)


H, R, N = Fate.HONOURED, Fate.REFUSED, Fate.NOTED

# -- model arguments -------------------------------------------------------------------------
_decide(H, "the base model: a local directory, or a hub id found in the local Hugging Face cache (offline)",
        "model_name_or_path")
_decide(H, "used when resolving a hub id in the Hugging Face cache and by LlamaFactory's loaders",
        "cache_dir model_revision")
_decide(H, "applied by LlamaFactory's tokenizer and model loading, as in llamafactory-cli train",
        "use_fast_tokenizer resize_vocab split_special_tokens add_tokens add_special_tokens "
        "new_special_tokens_config init_special_tokens rope_scaling flash_attn upcast_layernorm "
        "upcast_lmhead_output trust_remote_code print_param_status")
_decide(H, "must stay true: the layer-split trainer keeps one micro-batch pass of activations instead of "
        "recomputing them", "disable_gradient_checkpointing")
_decide(R, "continuing or merging existing adapters is not supported yet (it changes the base weights harvest "
        "shares with the served model); resume from a harvest checkpoint instead",
        "adapter_name_or_path adapter_folder create_new_adapter")
_decide(R, "it patches the model's attention or layers, which the layer-split trainer runs stage by stage itself",
        "shift_attn mixture_of_depths use_unsloth use_unsloth_gc enable_liger_kernel use_liger_kernel liger_kernel_config "
        "use_kt kt_weight_path "
        "kt_expert_checkpoint_path kt_use_lora_experts kt_lora_expert_num kt_lora_expert_intermediate_size")
_decide(R, "MoE auxiliary losses are not computed by the layer-split trainer (it supports dense "
        "Llama/Qwen2/Mistral-style decoders)", "moe_aux_loss_coef")
_decide(R, "quantized base weights (QLoRA) are not supported: the trainer's window copies the frozen weights as "
        "they are served", "quantization_method quantization_bit quantization_type double_quantization "
        "quantization_device_map")
_decide(R, "training from random weights is not LoRA finetuning of a served model", "train_from_scratch")
_decide(R, "set by LlamaFactory itself, not a job key", "compute_dtype device_map model_max_length block_diag_attn")
_decide(N, "an inference or export setting (llamafactory-cli chat/export); training does not read it",
        "infer_backend offload_folder use_kv_cache use_v1_kernels infer_dtype export_dir export_size export_device "
        "export_quantization_bit export_quantization_dataset export_quantization_nsamples "
        "export_quantization_maxlen export_legacy_format export_hub_model_id vllm_maxlen vllm_gpu_util "
        "vllm_enforce_eager vllm_max_lora_rank vllm_config sglang_maxlen sglang_mem_fraction sglang_tp_size "
        "sglang_config sglang_lora_backend")
_decide(N, "hub access is not used: models resolve from local directories or the local Hugging Face cache",
        "hf_hub_token ms_hub_token om_hub_token")
_decide(N, "a loading detail of LlamaFactory's model loader; it does not change the weights",
        "low_cpu_mem_usage use_reentrant_gc")
_decide(N, "multimodal preprocessing; harvest trains text-only decoders, where it has no effect",
        "image_max_pixels image_min_pixels image_do_pan_and_scan crop_to_patches video_max_pixels "
        "video_min_pixels video_fps video_maxlen use_audio_in_video audio_sampling_rate freeze_vision_tower "
        "freeze_multi_modal_projector freeze_language_model")

# -- data arguments --------------------------------------------------------------------------
_decide(H, "LlamaFactory's dataset registry and preprocessing, as in llamafactory-cli train (a relative "
        "dataset_dir or media_dir is taken relative to the job file)",
        "template dataset dataset_dir media_dir cutoff_len train_on_prompt mask_history max_samples overwrite_cache "
        "preprocessing_batch_size tool_format default_system enable_thinking preserve_thinking "
        "mix_strategy interleave_probs tokenized_path")
_decide(H, "as LlamaFactory's collator pads labels; with false the padding carries loss, so micro_batch_size auto "
        "pads per_device_train_batch_size samples together as llamafactory-cli train does (another micro_batch_size "
        "is accepted with a note that the loss then differs)", "ignore_pad_token_for_loss")
_decide(H, "honoured, but capped inside a decode server (harvest.yaml jobs) so preprocessing cannot take the "
        "serving process's cores; harvest train uses it as given", "preprocessing_num_workers")
_decide(H, "LlamaFactory's packing and its collator: packed rows keep each sequence's own position ids, and neat "
        "packing's block-diagonal attention mask reaches every decoder layer as llamafactory-cli train passes it",
        "packing neat_packing")
_decide(R, "harvest places each step's samples as a function of the step number (exact resume), which needs the "
        "dataset's length; streaming datasets have none", "streaming buffer_size")
_decide(N, "only matters when several processes preprocess on different machines", "data_shared_file_system")

# -- training arguments ----------------------------------------------------------------------
_decide(H, "as in the Hugging Face Trainer", "output_dir per_device_train_batch_size gradient_accumulation_steps "
        "num_train_epochs max_steps learning_rate lr_scheduler_type lr_scheduler_kwargs warmup_steps weight_decay "
        "adam_beta1 adam_beta2 adam_epsilon max_grad_norm seed data_seed resume_from_checkpoint "
        "overwrite_output_dir save_steps save_total_limit do_train")
_decide(H, "the optimizer: the torch-native ones of the Hugging Face Trainer's factory (see the optim check)",
        "optim optim_args")
_decide(H, "bf16 autocast as in the Hugging Face Trainer; fp16 (loss scaling) is refused by the optim/precision "
        "check", "bf16 fp16")
_decide(H, "steps or no (epoch-based saving is refused by the save check)", "save_strategy")
_decide(H, "checkpoints hold the adapter and trainer state only; such a checkpoint cannot be resumed exactly, "
        "so resuming from it is refused", "save_only_model")
_decide(H, "LlamaFactory's trainer_log.jsonl and the Hugging Face trainer_state.json, at these steps",
        "logging_strategy logging_steps logging_first_step")
_decide(H, "Hugging Face's reporter callbacks, where the reporter's package is installed (refused otherwise)",
        "report_to run_name project trackio_space_id trackio_bucket_id trackio_static_space_id")
_decide(H, "plain progress lines instead of a progress bar in harvest train", "disable_tqdm")
_decide(R, "distributed and offloading engines: harvest runs the job inside one decode process",
        "fsdp fsdp_config deepspeed parallelism_config")
_decide(R, "no hub access from a serving process; push the finished adapter separately",
        "push_to_hub hub_token hub_private_repo hub_model_id hub_strategy hub_always_push hub_revision")
_decide(R, "the layer-split trainer computes plain token cross-entropy, as llamafactory-cli train's default loss",
        "label_smoothing_factor")
_decide(R, "NEFTune's noise comes from the Hugging Face Trainer's hook on the embedding, which the layer-split "
        "trainer does not install", "neftune_noise_alpha")
_decide(R, "the layer-split trainer keeps one micro-batch pass of activations instead of recomputing them "
        "(as disable_gradient_checkpointing: true does)", "gradient_checkpointing gradient_checkpointing_kwargs")
_decide(R, "harvest compiles the decoder layers itself, per server, not per job: trainer.compile in harvest.yaml "
        "(harvest train --compile)", "torch_compile torch_compile_backend torch_compile_mode")
_decide(R, "a process-wide switch: inside a decode server it would change the served model's numerics too",
        "tf32")
_decide(R, "FP8 training is not supported by the layer-split trainer", "fp8 fp8_backend fp8_enable_fsdp_float8_all_gather")
_decide(R, "batch sizes are fixed by the job (harvest sizes its micro-batches itself, harvest.micro_batch_size)",
        "auto_find_batch_size")
_decide(R, "GaLore/APOLLO target modules: LlamaFactory refuses GaLore and APOLLO with LoRA", "optim_target_modules")
_decide(R, "every epoch's samples are used: the last step of an epoch takes what is left (as with "
        "dataloader_drop_last: false)", "dataloader_drop_last")
_decide(R, "harvest orders samples itself: shuffled per epoch, or in dataset order with disable_shuffling",
        "train_sampling_strategy sortish_sampler")
_decide(R, "prediction is not part of a harvest job; run llamafactory-cli with do_predict on the saved adapter",
        "do_predict predict_with_generate generation_max_length generation_num_beams generation_config")
_decide(N, "harvest feeds each step's samples from the trainer thread, not through a DataLoader",
        "dataloader_num_workers dataloader_pin_memory dataloader_persistent_workers dataloader_prefetch_factor "
        "dataloader_multiprocessing_context dataloader_in_order remove_unused_columns label_names "
        "length_column_name")
_decide(N, "one process, one device: there is nothing to distribute or gather",
        "average_tokens_across_devices ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers "
        "ddp_static_graph ddp_backend ddp_timeout local_rank save_on_each_node log_on_each_node "
        "accelerator_config ray_num_workers ray_init_kwargs master_addr master_port")
_decide(N, "harvest logs through its host process (the decode server or harvest train)",
        "log_level log_level_replica logging_nan_inf_filter debug skip_memory_metrics")
_decide(N, "harvest's own metrics and token counters cover it (see docs/metrics.md)",
        "include_num_input_tokens_seen include_effective_tokens_per_second enable_torch_profiler "
        "profiler_output_dir profiler_wait_steps profiler_warmup_steps profiler_active_steps profiler_repeat "
        "profiler_record_shapes profiler_profile_memory profiler_with_stack profile_modules")
_decide(N, "harvest always checkpoints on a stop and resumes at the exact step (data position is a function of "
        "the step), which these settings tune in the Hugging Face Trainer",
        "enable_jit_checkpoint ignore_data_skip restore_callback_states_from_checkpoint full_determinism "
        "torch_empty_cache_steps")
_decide(N, "the device is harvest.device (or the decode server's GPU)", "use_cpu")
_decide(N, "the model's KV cache is never used in training", "use_cache")

# -- finetuning arguments --------------------------------------------------------------------
_decide(H, "the job's method: stage sft with finetuning_type lora (others are refused by the method check)",
        "stage finetuning_type")
_decide(H, "LoRA as LlamaFactory configures it through PEFT", "lora_alpha lora_dropout lora_rank lora_target "
        "use_rslora")
_decide(H, "LoRA+ through LlamaFactory's own optimizer factory", "loraplus_lr_ratio loraplus_lr_embedding")
_decide(H, "through LlamaFactory's own optimizer factory, where its package is installed",
        "use_muon use_adam_mini")
_decide(H, "each epoch in dataset order (LlamaFactory's SequentialSampler)", "disable_shuffling")
_decide(H, "LlamaFactory's own plot_loss on trainer_state.json, at the end of training", "plot_loss")
_decide(R, "not tested with the layer-split trainer (DoRA/PiSSA read or rewrite the frozen base weights)",
        "use_dora pissa_init pissa_iter pissa_convert")
_decide(R, "training whole modules next to LoRA is not supported: the frozen weights are swapped through a window",
        "additional_target")
_decide(R, "LlamaFactory refuses GaLore, APOLLO and BAdam with LoRA", "use_galore use_apollo use_badam")
_decide(R, "LLaMA Pro adds and trains whole blocks, which is not LoRA", "use_llama_pro")
_decide(R, "other training engines or losses than the layer-split trainer's token cross-entropy",
        "use_mca use_hyper_parallel hyper_parallel_args use_dft_loss use_asft_loss use_eaft_loss")
_decide(R, "LlamaFactory's SwanLab callback is not driven by harvest; use report_to: swanlab (Hugging Face's "
        "reporter) instead", "use_swanlab")
_decide(R, "pure bf16 training (no fp32 master weights) is not supported; use bf16: true", "pure_bf16")
_decide(N, "freeze tuning, OFT and their options: no effect with finetuning_type: lora",
        "freeze_trainable_layers freeze_trainable_modules freeze_extra_modules module_dropout oft_rank "
        "oft_block_size oft_target")
_decide(N, "preference, reward and PPO stages only: no effect with stage: sft",
        "pref_beta pref_ftx pref_bco_weight pref_loss dpo_label_smoothing kto_chosen_weight kto_rejected_weight "
        "simpo_gamma ppo_buffer_size ppo_epochs ppo_score_norm ppo_target ppo_whiten_rewards ref_model "
        "ref_model_adapters ref_model_quantization_bit reward_model reward_model_adapters "
        "reward_model_quantization_bit reward_model_type ld_alpha")
_decide(N, "options of an optimizer or loss that is off (use_galore, use_apollo, use_badam, use_asft_loss, "
        "use_eaft_loss, use_swanlab)",
        "galore_target galore_rank galore_update_interval galore_scale galore_proj_type galore_layerwise "
        "apollo_target apollo_rank apollo_update_interval apollo_scale apollo_proj apollo_proj_type "
        "apollo_scale_type apollo_layerwise apollo_scale_front badam_mode badam_start_block badam_switch_mode "
        "badam_switch_interval badam_update_ratio badam_mask_mode badam_verbose asft_alpha eaft_alpha "
        "swanlab_project swanlab_workspace swanlab_run_name swanlab_mode swanlab_api_key swanlab_logdir "
        "swanlab_lark_webhook_url swanlab_lark_secret")

# -- generating arguments --------------------------------------------------------------------
_decide(N, "generation settings: used by llamafactory-cli chat/eval/predict, not by training",
        "do_sample temperature top_p top_k num_beams max_length max_new_tokens repetition_penalty length_penalty "
        "skip_special_tokens")

# -- evaluation ------------------------------------------------------------------------------
_decide(H, "evaluation runs on the trainer's own preemptible units and logs eval_loss like the Hugging Face "
        "Trainer", "do_eval eval_dataset val_size eval_on_each_dataset eval_strategy eval_steps eval_delay "
        "eval_on_start per_device_eval_batch_size")
_decide(R, "evaluation computes eval_loss only; metric-driven features are not supported",
        "load_best_model_at_end metric_for_best_model greater_is_better early_stopping_steps compute_accuracy "
        "batch_eval_metrics include_for_metrics eval_accumulation_steps eval_num_beams")
_decide(N, "how the Hugging Face Trainer gathers or casts evaluation outputs; harvest computes eval_loss directly",
        "prediction_loss_only eval_do_concat_batches eval_use_gather_object bf16_full_eval fp16_full_eval")

del H, R, N


def llamafactory_argument_fields() -> dict[str, dataclasses.Field]:
    """Every field of LlamaFactory's training argument dataclasses, by name."""
    from harvest.train.llamafactory_env import import_llamafactory

    import_llamafactory()
    from llamafactory.hparams.parser import _TRAIN_ARGS

    return {field.name: field for cls in _TRAIN_ARGS for field in dataclasses.fields(cls)}


def default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return field.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def is_default(value: Any, default: Any) -> bool:
    """Whether a YAML value is LlamaFactory's default (YAML gives ``1e-4`` or ``"none"`` where
    the dataclass holds a float or an enum)."""
    if value == default:
        return True
    default = getattr(default, "value", default)
    if value == default or (default is None and value in ("", "null", "None")):
        return True
    if isinstance(value, bool) or isinstance(default, bool):
        return False
    return str(value) == str(default)


def judge(given: Mapping[str, Any], fields: Mapping[str, dataclasses.Field]) -> tuple[list[tuple[str, str]], list[str]]:
    """(refusals as (key, message), notes) for the keys a job sets. Keys at their default
    pass without a word; unknown keys are for the caller (LlamaFactory's parser names them)."""
    refusals, notes = [], []
    for key, value in given.items():
        fate = KEY_FATES.get(key)
        field = fields.get(key)
        if fate is None or field is None or fate.fate is Fate.HONOURED or is_default(value, default_of(field)):
            continue
        if fate.fate is Fate.REFUSED:
            refusals.append((key, f"{key}: {value!r} is not supported by harvest: {fate.reason}"))
        else:
            notes.append(f"{key}: {value!r} has no effect in harvest: {fate.reason}")
    return refusals, notes


def markdown_table(keys: Iterable[str] | None = None) -> str:
    """The key table of docs/jobs.md: one row per key, grouped by fate, then by reason."""
    keys = sorted(KEY_FATES) if keys is None else sorted(keys)
    lines = ["| Key | Fate | Why |", "|---|---|---|"]
    order = {Fate.HONOURED: 0, Fate.REFUSED: 1, Fate.NOTED: 2}
    for key in sorted(keys, key=lambda k: (order[KEY_FATES[k].fate], k)):
        fate = KEY_FATES[key]
        lines.append(f"| `{key}` | {fate.fate.value} | {fate.reason} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
