// hgc.h — C ABI of libharvest_greenctx: SM partitioning with CUDA green contexts
// ("hgc" = harvest green contexts).
//
// Note [SM ladder]
// Rationale: harvest gives the finetune trainer the SMs that decode does not need at this
// step (docs/design.md §4, Harli (arXiv:2511.11729) §6-§7). Green contexts partition a
// GPU's streaming multiprocessors (SMs) inside one process, and work launched on a stream of a green
// context runs only on that context's SMs. Creating contexts is far too slow for the
// decode step (a split plus two cuGreenCtxCreate per level, milliseconds), so every
// partition that may be used is created once at start-up: the *ladder*.
// Approach: a ladder is a list of levels, each a (decode, trainer) pair. A partial level
// comes from ONE cuDevSmResourceSplitByCount of the whole device with nbGroups = 1: the
// group (asked for `decode_sms`, rounded UP by the driver to its partition granularity)
// becomes the decode green context, and the remainder (total - group) the trainer green
// context. Taking both sides from the same split is what makes them disjoint; two
// separate splits may overlap (pytorch/pytorch#195378). A level that asks for the whole
// device gets a plain stream in the primary context and no trainer (trainer paused).
// Every green context gets one non-blocking stream, made with cuGreenCtxStreamCreate
// (driver 12.5+) or, on 12.4, by making the context from cuCtxFromGreenCtx current and
// calling cuStreamCreate. The SM counts reported per level are the ones the driver
// actually provisioned (cuGreenCtxGetDevResource), not the ones asked for.
// Which levels to build is policy, planned in Python (harvest/compute/ladder.py);
// hgc_split_preview runs the driver's split without creating anything so the planner can
// see realised counts before committing.
// Limitations: different levels overlap each other (only one level is active at a
// time); a level switch applies to work launched after it, so kernels already queued on
// the previous level's trainer stream finish on their old SMs (bounded by one trainer
// unit). The driver may let a kernel use MORE SMs than provisioned (MPS with an active
// thread percentage; on cc 9.x, 2 extra SMs once a module using dynamic parallelism is
// loaded) but never fewer. Only the split's group has the driver's co-scheduling
// guarantees (whole GPU processing clusters); the remainder does not, so decode, whose
// QoS matters, is the group, and trainer kernels that use thread-block clusters may run
// with less occupancy on the remainder. Streams beyond CUDA_DEVICE_MAX_CONNECTIONS hardware queues
// share queues, which can add false dependencies between streams. A ladder is owned by
// one thread: create, query and destroy are not synchronised against each other.
//
// Conventions: 0 on success; otherwise a non-zero hgc_status and the text (naming the
// constraint, or the driver call and its code) in hgc_last_error() on the same thread.
// Arguments are checked before the driver is touched. Nothing aborts the process.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HGC_EXPORT __attribute__((visibility("default")))

// A ladder holds at most this many levels (the decode side may keep one CUDA graph set
// per level, so a long ladder costs memory); harvest/compute/ladder.py uses the same bound.
#define HGC_MAX_LEVELS 8

enum hgc_status {
  HGC_OK = 0,
  HGC_ERR_INVALID = 1,       // bad argument (the message names the constraint)
  HGC_ERR_NO_DRIVER = 2,     // no usable CUDA driver
  HGC_ERR_DRIVER = 3,        // a driver call failed
  HGC_ERR_UNSUPPORTED = 4,   // driver older than green contexts (needs 12.4+)
};

HGC_EXPORT const char* hgc_version(void);
HGC_EXPORT const char* hgc_last_error(void);

typedef struct hgc_device_info {
  char name[256];
  int driver_version;            // e.g. 12080
  int sm_count;                  // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
  int cc_major, cc_minor;        // compute capability
  uint64_t total_memory_bytes;
  int green_contexts_supported;  // driver has every green-context entry point harvest uses
  // Partition constraints as the driver reports them (CUDA 13 headers); 0 when the
  // driver does not report them, in which case the caller applies the known arch rules.
  int min_sm_partition_size;
  int sm_coscheduled_alignment;
} hgc_device_info_t;

HGC_EXPORT int hgc_device_info(int device_ordinal, hgc_device_info_t* out);

// Dry run of the split a ladder level would make for `decode_sms`: the SM counts the
// driver would give decode (the group) and the trainer (the remainder). Creates nothing.
// decode_sms equal to the device's SM count previews the whole-device level (trainer 0).
HGC_EXPORT int hgc_split_preview(int device_ordinal, int decode_sms, int* realised_decode_sms,
                                 int* realised_trainer_sms);

typedef struct hgc_ladder hgc_ladder_t;  // opaque; owns every context and stream below

typedef struct hgc_ladder_info {
  int device_ordinal;
  int total_sms;          // SMs of the whole device (cuDeviceGetDevResource)
  int num_levels;
  int green_stream_api;   // 1: streams from cuGreenCtxStreamCreate; 0: the 12.4 fallback
} hgc_ladder_info_t;

typedef struct hgc_level_info {
  int decode_sms;           // provisioned SMs of the decode side
  int trainer_sms;          // provisioned SMs of the trainer side; 0 for the whole-device level
  uint64_t decode_stream;   // CUstream (non-blocking), valid until hgc_ladder_destroy
  uint64_t trainer_stream;  // CUstream, or 0 when trainer_sms == 0
} hgc_level_info_t;

// Builds one level per entry of `decode_sms` (requested decode SM counts, strictly
// ascending, 1..HGC_MAX_LEVELS entries; an entry equal to the device's SM count is the
// whole-device level). On failure everything created so far is released and *out is
// left untouched.
HGC_EXPORT int hgc_ladder_create(int device_ordinal, const int* decode_sms, int num_levels,
                                 hgc_ladder_t** out);
HGC_EXPORT int hgc_ladder_get_info(const hgc_ladder_t* ladder, hgc_ladder_info_t* out);
HGC_EXPORT int hgc_ladder_get_level(const hgc_ladder_t* ladder, int index, hgc_level_info_t* out);
// Waits for every stream of the ladder, then destroys streams, green contexts and the
// primary-context reference, in that order. Always frees the ladder (NULL is a no-op);
// returns non-zero when a stream failed to drain, with the message naming it.
HGC_EXPORT int hgc_ladder_destroy(hgc_ladder_t* ladder);

// Calibration kernel: `num_blocks` blocks of HGC_SPIN_THREADS threads, each thread
// running four independent chains of `iterations` dependent FMAs. Its time is set by
// the SMs it may use, nothing else, so it shows whether a partition is real. The kernel
// is JIT-compiled from PTX once per process (context-independent, cuLibraryLoadData) and
// runs in the context of `stream`. Asynchronous; also capturable into a CUDA graph.
#define HGC_SPIN_THREADS 128
HGC_EXPORT int hgc_launch_spin_kernel(uint64_t stream, int num_blocks, int iterations);
// The kernel's PTX text (for offline checks with ptxas).
HGC_EXPORT const char* hgc_spin_kernel_ptx(void);

#ifdef __cplusplus
}
#endif
