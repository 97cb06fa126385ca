"""Two-stage decode-latency predictor, calibration profiles and online refinement.

Pure Python: importing this package loads neither torch nor numpy nor scikit-learn
(fitting imports scikit-learn when it runs). The profiler that measures profiles lives
in :mod:`harvest.predict.profiler` and needs torch.

Typical use (the scheduler)::

    profile = compat.load_for(path, running_identity, allow_mismatch=False)
    predictor = profile.predictor()
    predictor.predict_levels(batch_size, sum_context, solo_out, colo_out)
"""

from harvest.predict.buckets import BatchSizeBuckets
from harvest.predict.compat import ProfileMismatchError, RuntimeIdentity, check_compatible, load_for, model_config_hash
from harvest.predict.fit import FitError, FitQuality, LatencySample, fit_corun, fit_models, fit_solo
from harvest.predict.latency_model import CoRunCoefficients, LatencyPredictor, ProfiledRange, SoloCoefficients
from harvest.predict.online import OnlineRefiner, OnlineSettings
from harvest.predict.schema import SCHEMA_VERSION, Profile, ProfileError

__all__ = [
    "BatchSizeBuckets",
    "CoRunCoefficients",
    "FitError",
    "FitQuality",
    "LatencyPredictor",
    "LatencySample",
    "OnlineRefiner",
    "OnlineSettings",
    "Profile",
    "ProfileError",
    "ProfileMismatchError",
    "ProfiledRange",
    "RuntimeIdentity",
    "SCHEMA_VERSION",
    "SoloCoefficients",
    "check_compatible",
    "fit_corun",
    "fit_models",
    "fit_solo",
    "load_for",
    "model_config_hash",
]
