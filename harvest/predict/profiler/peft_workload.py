"""Co-run workload: a real PEFT LoRA training step on the finetune base model.

Used when no harvest trainer job is given. Units are whole-model: ``forward`` (autograd
recording, loss computed, graph dropped) and ``backward`` (through a graph recorded once
and retained, LoRA gradients computed then dropped). No optimizer step: it would change the
parameters the retained graph saved, and a LoRA AdamW step is negligible next to a
backward pass. The split lets the profiler fit stage 2 per trainer phase. The data are
random in-vocabulary tokens: a step's cost depends on shapes, not values.
"""

from __future__ import annotations

from harvest.engines.transformers.model import load_causal_lm
from harvest.predict.profiler.corun import CoRunError, UnitLoopWorkload
from harvest.predict.profiler.engines import synthetic_token_ids


def shape_problem(lora_rank: int, micro_batch_size: int, sequence_length: int) -> str | None:
    """What is wrong with the workload's shape, naming the flag (`harvest profile` checks it
    before it loads anything); None when nothing is."""
    for flag, value, least in (("--lora-rank", lora_rank, 1), ("--trainer-micro-batch", micro_batch_size, 1),
                               ("--trainer-seq-len", sequence_length, 2)):
        if value < least:
            return f"{flag}={value}: must be >= {least}"
    return None


class PeftLoraWorkload(UnitLoopWorkload):
    name = "peft-lora"
    phases = ("forward", "backward")

    def __init__(
        self,
        base_model: str,
        device: str,
        dtype: str,
        random_weights: bool,
        lora_rank: int = 8,
        micro_batch_size: int = 2,
        sequence_length: int = 128,
        seed: int = 0,
    ):
        super().__init__()
        problem = shape_problem(lora_rank, micro_batch_size, sequence_length)
        if problem is not None:
            raise CoRunError(f"PEFT workload: {problem}")
        import torch
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed)
        model = load_causal_lm(base_model, device, dtype, random_weights)
        model.train()
        config = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
        self.model = get_peft_model(model, config)
        rows = [synthetic_token_ids(sequence_length, model.config.vocab_size, salt) for salt in range(micro_batch_size)]
        self.input_ids = torch.tensor(rows, device=device)
        self.base_model = base_model
        self.description = (
            f"PEFT LoRA r={lora_rank} alpha={2 * lora_rank} on all linear layers of {base_model}, "
            f"micro-batch {micro_batch_size} x {sequence_length} tokens; units: whole-model "
            f"forward | backward (retained graph, no optimizer step)"
        )
        self._retained_loss = None
        self._torch = torch
        self._micro_batch_tokens = micro_batch_size * sequence_length

    @property
    def micro_batch_tokens(self) -> float:
        return float(self._micro_batch_tokens)

    @property
    def tokens_per_unit(self) -> float:
        # A training step on one micro-batch is one forward and one backward unit.
        return self._micro_batch_tokens / len(self.phases)

    def _forward(self):
        with self._torch.enable_grad():
            return self.model(input_ids=self.input_ids, labels=self.input_ids).loss

    def run_unit(self, phase: str) -> None:
        if phase == "forward":
            self._forward()
        elif phase == "backward":
            if self._retained_loss is None:
                self._retained_loss = self._forward()
            self._retained_loss.backward(retain_graph=True)
            self.model.zero_grad(set_to_none=True)
        else:
            raise CoRunError(f"{self.name}: unknown phase {phase!r}")
        if self.input_ids.is_cuda:
            self._torch.cuda.current_stream().synchronize()

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self._retained_loss = None  # frees the retained graph between co-run blocks

    def close(self) -> None:
        self.model = None
