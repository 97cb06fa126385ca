"""`harvest profile`: measure decode-step latencies on every ladder level, alone and
beside the finetune job, and fit them into a calibration profile.

Needs torch (and SGLang or transformers for the decode engine, PEFT or harvest's trainer
for the co-run workload); the predictor itself (:mod:`harvest.predict`) does not.
"""
