"""The trainer's error types: misconfiguration (refuse to start) versus transient shortage."""

from __future__ import annotations


class JobError(ValueError):
    """A finetune job definition is unusable. The message names the field, the value and the fix.

    Raised before any training starts; nothing has been written when it is raised.
    """


class CheckpointError(RuntimeError):
    """A checkpoint cannot be resumed from (corrupt, torn, or from a different job).

    The trainer refuses instead of silently starting over.
    """


class WeightSourceError(ValueError):
    """A weight source does not provide a tensor the model needs, or provides one of the
    wrong shape, dtype or device. The message names the tensor."""


class WindowMemoryUnavailable(RuntimeError):
    """Transient: the window allocator cannot give memory for the stage the next unit needs,
    even after everything else was evicted. The caller backs off and retries later; the
    trainer's state is unchanged (the unit did not run)."""


class TrainingDiverged(RuntimeError):
    """The loss of a step is not finite (NaN or infinity). Raised before that step's update,
    so the weights and the checkpoint written on the way out are the last good step's.
    The message names the key to change (learning_rate)."""

    @classmethod
    def before_update(cls, step: int, loss: float, *, first_update: bool) -> "TrainingDiverged":
        """Step ``step`` (0-based) has the non-finite ``loss``. ``first_update``: step 0 and
        no update ever ran, so the rate cannot be the cause. (After a resume the last
        run's update may be, so that case keeps the learning_rate message.)"""
        if first_update:
            return cls(
                f"model_name_or_path: step 1 has a non-finite loss ({loss}) before any weight was updated, so "
                f"not because of learning_rate: the model as loaded gives it on this data (check the base "
                f"model's weights and dtype, the adapter it starts from, and the data)")
        return cls(
            f"learning_rate: step {step + 1} has a non-finite loss ({loss}); training stopped before "
            f"the update, the checkpoint keeps step {step} (lower learning_rate, or check the data)")
