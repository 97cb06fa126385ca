"""A PEFT causal LM cut into stages that run forward and backward one at a time.

Stages: 0 = token embedding, 1..L = decoder layers, L+1 = final norm + LM head + loss. A
stage's forward takes the previous stage's output detached (a fresh leaf requiring grad
when something below is trainable) and keeps its input and output; its backward is an
explicit ``torch.autograd.backward(output, grad)`` handing ``input.grad`` down, or, for a
layer run as a compiled pair (harvest.train.compiled_pair), that pair's backward function. Positions,
rotary embeddings and masks are computed once per micro-batch, in the embedding stage.
Invariant: a micro-batch's loss is divided by the label tokens of the whole optimizer step
(``num_items_in_batch``), so gradients accumulated over any split equal the full batch's.
Supported: Llama/Qwen2/Mistral-shaped decoders, per-layer ``config.layer_types`` honoured.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch import nn

from harvest.train.compiled_units import CompiledLayers, compile_layers
from harvest.train.errors import JobError
from harvest.train.window import StageLayout

_BASE_LAYER = re.compile(r"\.base_layer(?=\.|$)")


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch's tensors and what its units keep between forward and backward."""

    index: int
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None  # 2-D, LlamaFactory's 4-D neat-packing mask, or None (data.micro_batch_from)
    labels: torch.Tensor
    num_tokens: int  # non-padding tokens
    num_label_tokens: int = 0  # tokens that carry loss, after the causal shift
    position_ids: torch.Tensor | None = None  # the batch's (packing), else 0.. set by the embedding stage
    position_embeddings: Any = None
    masks: dict[str, Any] = dataclasses.field(default_factory=dict)
    hidden: torch.Tensor | None = None  # output of the last stage run forward
    inputs: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # kept for backward
    outputs: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    # stage -> what a layer's compiled pair saved for its backward (compiled_pair.SavedForBackward)
    pair_saved: dict[int, Any] = dataclasses.field(default_factory=dict)
    grad: torch.Tensor | None = None  # d loss / d output of the next stage to run backward
    loss: torch.Tensor | None = None


class SplitCausalLM:
    def __init__(self, peft_model: nn.Module):
        self.peft_model = peft_model
        causal_lm = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
        decoder = getattr(causal_lm, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if decoder is None or not all(hasattr(decoder, a) for a in needed) or not hasattr(causal_lm, "lm_head"):
            raise JobError(f"model_name_or_path: architecture {type(causal_lm).__name__} is not supported by the "
                           "layer-split trainer (needs model.embed_tokens/layers/norm/rotary_emb and lm_head, "
                           "as Llama, Qwen2 and Mistral have)")
        self.causal_lm = causal_lm
        self.config = causal_lm.config
        self.decoder = decoder
        self.num_layers = len(decoder.layers)
        self.head_stage = self.num_layers + 1
        self.num_stages = self.num_layers + 2
        self.stage_names = ["embed"] + [f"layer.{i}" for i in range(self.num_layers)] + ["head"]
        self._stage_roots = [[("model.embed_tokens", decoder.embed_tokens)]]
        self._stage_roots += [[(f"model.layers.{i}", layer)] for i, layer in enumerate(decoder.layers)]
        self._stage_roots.append([("model.norm", decoder.norm), ("lm_head", causal_lm.lm_head)])
        self._check_coverage()
        trainable = [any(p.requires_grad for _, root in roots for p in root.parameters())
                     for roots in self._stage_roots]
        if not any(trainable):
            raise JobError("lora_target: no trainable parameter was created (check lora_target and finetuning_type)")
        self.first_trainable_stage = trainable.index(True)
        layer_types = getattr(self.config, "layer_types", None) or ["full_attention"] * self.num_layers
        self._layer_types = list(layer_types)
        self.compiled = CompiledLayers("off")  # harvest.train.compiled_units: set by compile_layers

    def compile_layers(self, requested: str, device: torch.device, *, tensor_parallel: bool = False,
                       backend: Any = None, pairs: bool | None = None) -> CompiledLayers:
        """``trainer.compile``: the decoder layers' units compiled in place (the embedding
        and head stages stay eager: one unit each per micro-batch); ``pairs``: see
        harvest.train.compiled_units.compile_layers."""
        self.compiled = compile_layers(list(self.decoder.layers), requested, device,
                                       tensor_parallel=tensor_parallel, backend=backend, pairs=pairs)
        return self.compiled

    # -- structure -----------------------------------------------------------------------
    def frozen_tensors(self, stage: int) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
        """(state-dict name, module, attribute, tensor) of every frozen parameter of `stage`."""
        found = []
        for prefix, root in self._stage_roots[stage]:
            for module_name, module in root.named_modules(remove_duplicate=False):
                for attr, param in module._parameters.items():
                    if param is None or param.requires_grad:
                        continue
                    full = ".".join(p for p in (prefix, module_name, attr) if p)
                    found.append((_BASE_LAYER.sub("", full), module, attr, param.detach()))
        return found

    def layouts(self) -> list[StageLayout]:
        return [StageLayout.build(s, self.stage_names[s], self.frozen_tensors(s)) for s in range(self.num_stages)]

    def pass_stages(self) -> list[int]:
        """Stage order of one micro-batch pass: forward bottom-up, then backward top-down."""
        return list(range(self.num_stages)) + list(range(self.head_stage, self.first_trainable_stage - 1, -1))

    def backward_stages(self) -> list[int]:
        return list(range(self.head_stage, self.first_trainable_stage - 1, -1))

    # -- units ---------------------------------------------------------------------------
    def forward(self, stage: int, mb: MicroBatch, num_label_tokens: int) -> None:
        if stage == 0:
            self._embed_forward(mb)
        elif stage == self.head_stage:
            self._head_forward(mb, num_label_tokens)
        else:
            self._layer_forward(stage, mb)

    def backward(self, stage: int, mb: MicroBatch) -> None:
        output = mb.outputs.pop(stage)
        stage_input = mb.inputs.pop(stage, None)
        saved = mb.pair_saved.pop(stage, None)
        if saved is not None:
            mb.grad = saved.backward(mb.grad)
        else:
            torch.autograd.backward(output, grad_tensors=mb.grad)
            mb.grad = stage_input.grad if stage_input is not None and stage_input.requires_grad else None
        if stage == self.first_trainable_stage:
            mb.grad = None

    def _stage_input(self, stage: int, mb: MicroBatch) -> torch.Tensor:
        return mb.hidden.detach().requires_grad_(stage > self.first_trainable_stage)

    def _keep(self, stage: int, mb: MicroBatch, stage_input: torch.Tensor | None, output: torch.Tensor) -> None:
        if stage >= self.first_trainable_stage:
            if stage_input is not None:
                mb.inputs[stage] = stage_input
            mb.outputs[stage] = output

    def _embed_forward(self, mb: MicroBatch, training: bool = True) -> None:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        with torch.set_grad_enabled(training and self.first_trainable_stage == 0):
            hidden = self.decoder.embed_tokens(mb.input_ids)
        if mb.position_ids is None:  # as the Hugging Face model forward does without position_ids
            mb.position_ids = torch.arange(mb.input_ids.shape[1], device=hidden.device).unsqueeze(0)
        mask_kwargs = dict(config=self.config, inputs_embeds=hidden, attention_mask=mb.attention_mask,
                           past_key_values=None, position_ids=mb.position_ids)
        mb.masks = {"full_attention": create_causal_mask(**mask_kwargs)}
        if "sliding_attention" in self._layer_types:
            mb.masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)
        mb.position_embeddings = self.decoder.rotary_emb(hidden, mb.position_ids)
        if training:
            self._keep(0, mb, None, hidden)
        mb.hidden = hidden

    def _layer_forward(self, stage: int, mb: MicroBatch, training: bool = True) -> None:
        layer_index = stage - 1
        stage_input = self._stage_input(stage, mb) if training else mb.hidden
        mask = mb.masks[self._layer_types[layer_index]]
        trains = training and stage >= self.first_trainable_stage
        paired = self.compiled.paired_layer(layer_index) if trains else None
        result = paired.forward(stage_input, mask, mb.position_ids, mb.position_embeddings) if paired else None
        if result is not None:
            output, mb.pair_saved[stage] = result
        else:
            with torch.set_grad_enabled(trains):
                output = self.decoder.layers[layer_index](
                    stage_input, attention_mask=mask, position_ids=mb.position_ids,
                    position_embeddings=mb.position_embeddings)
            if isinstance(output, tuple):  # older decoder layers return (hidden, ...)
                output = output[0]
        if training:
            self._keep(stage, mb, stage_input, output)
        mb.hidden = output

    def _head_forward(self, mb: MicroBatch, num_label_tokens: int) -> None:
        stage_input = self._stage_input(self.head_stage, mb)
        with torch.enable_grad():
            logits = self.causal_lm.lm_head(self.decoder.norm(stage_input))
            loss = self.causal_lm.loss_function(logits=logits, labels=mb.labels, vocab_size=self.config.vocab_size,
                                                num_items_in_batch=num_label_tokens)
        self._keep(self.head_stage, mb, stage_input, loss)
        mb.loss = loss.detach()
        mb.hidden = None
        mb.masks, mb.position_embeddings = {}, None  # every layer has run forward

    def evaluate(self, stage: int, mb: MicroBatch) -> None:
        """Forward of one stage without gradients (evaluation); the head stage sets
        ``mb.loss`` to the micro-batch's mean token loss, as ``model(**batch).loss`` gives."""
        with torch.no_grad():
            if stage == 0:
                self._embed_forward(mb, training=False)
            elif stage == self.head_stage:
                logits = self.causal_lm.lm_head(self.decoder.norm(mb.hidden))
                mb.loss = self.causal_lm.loss_function(logits=logits, labels=mb.labels,
                                                       vocab_size=self.config.vocab_size,
                                                       num_items_in_batch=mb.num_label_tokens)
                mb.hidden, mb.masks, mb.position_embeddings = None, {}, None
            else:
                self._layer_forward(stage, mb, training=False)

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prepare) -> torch.Tensor:
        """Inference through all stages (no grad); `prepare(stage)` makes a stage resident."""
        mb = MicroBatch(-1, input_ids, attention_mask, labels=input_ids, num_tokens=0)
        with torch.no_grad():
            prepare(0)
            self._embed_forward(mb, training=False)
            for stage in range(1, self.head_stage):
                prepare(stage)
                self._layer_forward(stage, mb, training=False)
            prepare(self.head_stage)
            return self.causal_lm.lm_head(self.decoder.norm(mb.hidden))

    def _check_coverage(self) -> None:
        covered = {id(p) for roots in self._stage_roots for _, root in roots for p in root.parameters()}
        outside = [name for name, p in self.causal_lm.named_parameters() if id(p) not in covered]
        if outside:
            raise JobError(f"model_name_or_path: parameter {outside[0]!r} lies outside the embedding, decoder layers "
                           "and head, so the layer-split trainer cannot place it")
