/* unbounded-nvidia-setup test fixture: a simulated libnvidia-ml.so.1 (NVML).
 *
 * Built by tests/elfbuild.py (gcc -shared -fPIC, SONAME libnvidia-ml.so.1) into every
 * simulated machine's staging as libnvidia-ml.so.<driver version>. It answers as the real
 * NVML of a GPU host would, from the machine's files, so that NVIDIA's real nvidia-ctk
 * (1.20, a lazily bound cgo binary that dlopens the driver root's libnvidia-ml.so.1), the
 * nvidia-ctk test stand-in (ctypes) and the product all read the same simulated machine.
 *
 * The machine: the prefix P of this library's own real path (dladdr + realpath), the part
 * before its first "/run/nvidia/" or "/run/host-nvidia/" component. A machine under
 * `--root <root>` has its staging at <root>/run/host-nvidia/0 and its driver root at
 * <root>/run/nvidia/driver, so P = <root> wherever the library is loaded from; in a booted
 * test machine (library at /run/nvidia/driver/...) P = "", the machine's own /. A library
 * whose path has neither component (a container's /usr/lib/...) reads "" too, the
 * caller's own kernel, as the real NVML does. No environment variable is involved. P is
 * found when the library is loaded and kept as an O_PATH descriptor, so a caller that
 * loads it and then chroots (the stand-in isolates NVML's init so) still reads P.
 *
 * The state directory, the one difference from a real node: when the directory
 * /run/simulated-nvml exists in the caller's mount namespace when the library is loaded
 * (kept as an O_PATH descriptor, like P), the module's files below, written here as
 * P/proc/driver/..., are read from /run/simulated-nvml/... instead (nvidia/gpus/<bus>/...,
 * nvidia/simulated-nvml-reading, nvidia/simulated-nvml-devices; a test bind-mounts a
 * machine's proc/driver there, read-only). It is for a container: a real NVML reads the host kernel's /proc/driver,
 * which is not namespaced, so a container sees the host's module through it; runc mounts
 * a fresh /proc in a container (this host's kernel lists no NVIDIA module there) and
 * refuses bind mounts under /proc, and a library at /driver-root/lib/... has P = "", so
 * without the directory it would read the container's empty /proc and answer 9.
 * P/dev/nvidiactl and P/dev/nvidia<minor> are still read where they were (in a
 * container, P = "": the container's own /dev, CDI-injected nodes). Without the
 * directory nothing changes.
 *
 * State, read again at every first nvmlInit* (refcount 0 -> 1; nvidia-ctk inits and
 * shuts NVML down several times per run):
 *   P/dev/nvidiactl             must be a character device (the node NVML talks to the
 *                               kernel module through)
 *   P/proc/driver/nvidia/gpus/<PCI bus id>/information
 *                               the kernel module's own file, one per GPU: "Model:",
 *                               "GPU UUID:", "Device Minor:" lines. NVML index = position
 *                               in bus id order.
 * Without both (nvidiactl and at least one GPU NVML enumerates) every init answers 9,
 * Driver Not Loaded, as on a machine without a loaded module. An information file whose
 * "GPU Excluded:" reads Yes (the host's NVreg_ExcludedGpus; its "GPU UUID:" then reads
 * GPU-????????-????-????-????-????????????) is not enumerated: NVML's count and indices
 * skip it, as the real library's do, though its /dev/nvidia<minor> stays. Beside each
 * information file, a file the real module never writes, with this simulation's own
 * state of that GPU (absent: healthy, MIG off):
 *   P/proc/driver/nvidia/gpus/<bus>/simulated-nvml, lines:
 *     error <code>              getting a handle answers <code> (4 No Permission, 8
 *                               Insufficient Power, 11 IRQ Issue, 15 GPU is lost, 999
 *                               Unknown) for the lookups the reading below says; the
 *                               device count still includes the GPU
 *     lost                      the GPU fell off the bus (Xid 79): "error 15"
 *     hang                      a GPU whose GSP stopped answering: getting a handle
 *                               blocks, never returning, for the lookups an "error"
 *                               would fail (the reading below, as a code other than 8
 *                               and 11); with an "error" or "lost" line too, it hangs
 *     query-error <function> <code>
 *                               the GPU's handles are got as its state otherwise says,
 *                               but <function>, called with its handle (or one of its
 *                               MIG devices'), answers <code> (> 0; 999 Unknown, 15,
 *                               4, ...) after its argument checks (those answer 2 as
 *                               before), instead of its own answer. <function>, a
 *                               per-device query by its base name (versioned entry
 *                               points follow it): nvmlDeviceGetUUID,
 *                               nvmlDeviceGetName, nvmlDeviceGetMinorNumber,
 *                               nvmlDeviceGetIndex, nvmlDeviceGetPciInfo (_v2, _v3),
 *                               nvmlDeviceGetMemoryInfo, nvmlDeviceGetAttributes (_v2),
 *                               nvmlDeviceGetCudaComputeCapability,
 *                               nvmlDeviceGetMigMode, nvmlDeviceGetMaxMigDeviceCount,
 *                               nvmlDeviceGetMigDeviceHandleByIndex,
 *                               nvmlDeviceIsMigDeviceHandle,
 *                               nvmlDeviceGetDeviceHandleFromMigDeviceHandle,
 *                               nvmlDeviceGetGpuInstanceId,
 *                               nvmlDeviceGetComputeInstanceId. Several lines allowed.
 *     hang <function>           <function> (as above), called with the GPU's handle (or
 *                               one of its MIG devices'), blocks after its argument
 *                               checks, never returning. A blocked call sleeps
 *                               (nanosleep) with signals as the caller left them: a
 *                               signal that kills the caller (SIGTERM, SIGKILL) ends it.
 *     mig                       MIG mode enabled (nvmlDeviceGetMigMode 1/1; else 0/0)
 *     mig-device <slot> <gi id> <ci id> <gi profile 0..17> <ci profile 0..8> <MIG-uuid>
 *                               a MIG device (compute instance) in slot 0..6 of the 7
 *                               (nvmlDeviceGetMaxMigDeviceCount); an empty slot answers
 *                               6, Not Found. Profile info ids equal the profile index.
 * A query-error or hang line that does not parse, or names a function not listed, makes
 * every init answer 999, as a reading word the library does not know does (below), so a
 * typo in a test cannot pass for a healthy GPU. Other lines are ignored.
 *
 * Which lookups a GPU's error fails: NVML's header (go-nvml's nvml.h) ties GPU_IS_LOST to
 * "the target GPU" by index and by PCI bus id, but by UUID to "any GPU" ("NVML may
 * initialize additional GPUs as it searches for the target GPU"), and INSUFFICIENT_POWER
 * and IRQ_ISSUE to "any attached devices"/"the attached GPUs" even by index. No GPU here
 * can say which reading real hardware follows, so the machine picks one, in a
 * machine-wide file read at every first init like the per-GPU state:
 *   P/proc/driver/nvidia/simulated-nvml-reading   one word (absent: target; a word not
 *                                                 below: every init answers 999)
 * E = the failing GPU's code; "first" = the lowest NVML index whose GPU has an error.
 * A GPU that hangs is a GPU with an error whose E is "block" (never 8 or 11): where the
 * table answers its E, the lookup blocks instead; e.g. under any every lookup by UUID
 * blocks, under walk a lookup by UUID whose search reaches it, under target only a
 * lookup of that GPU itself.
 *
 *   reading  lookup                       fails with
 *   -------  ---------------------------  ----------------------------------------------
 *   target   by index / PCI bus id        the target GPU's E (any code), else succeeds
 *            by UUID (GPU or MIG)         the target GPU's E (a MIG device: its GPU's)
 *   walk     any lookup, any GPU          8 or 11 of the first GPU with 8 or 11, if any
 *            by index / PCI bus id        else the target GPU's E (4, 15, 999)
 *            by UUID (GPU or MIG)         else E of the first GPU with an error at or
 *                                         before the target's index (the search walks
 *                                         GPUs 0, 1, ... up to the target); a UUID no GPU
 *                                         has walks them all: first error, else 6
 *   any      any lookup, any GPU          8 or 11 of the first GPU with 8 or 11, if any
 *            by index / PCI bus id        else the target GPU's E (4, 15, 999)
 *            by UUID (GPU or MIG)         else E of the first GPU with an error, whatever
 *                                         the target; none: the target, or 6
 *
 * A GPU's device node, in NVML run in a container that lacks it (CDI gave the container
 * other GPUs only): a second machine-wide file, read at every first init like the
 * reading, says what NVML does with a GPU whose P/dev/nvidia<minor> is not a character
 * device (in a container P = "": the container's own /dev):
 *   P/proc/driver/nvidia/simulated-nvml-devices   one word (absent: device nodes other
 *                                                 than nvidiactl are not looked at; a
 *                                                 word not below: every init answers 999)
 *   skip     the GPU is not enumerated: count and indices skip it, as for an excluded
 *            GPU (no other GPU left: init answers 9)
 *   deny     the GPU is counted and its handle lookups answer 4, No Permission, as an
 *            "error 4" would in the machine's reading (walk and any: lookups by UUID of
 *            other GPUs too), whatever its simulated-nvml says of its lookups
 *
 * The event API (what NVIDIA's device plugin's health checks call): every GPU supports
 * single- and double-bit ECC, PState, Xid and MIG-config events (0x10F).
 * nvmlDeviceRegisterEvents and nvmlDeviceGetSupportedEventTypes on a GPU with an error
 * answer as a lookup of that GPU by index does in the machine's reading (the header ties
 * their GPU_IS_LOST to "the target GPU"; a GPU that hangs blocks them); a MIG device's
 * handle stands for its GPU. Types outside nvmlEventTypeAll answer 2; a
 * supported-but-unlisted type 3, registering none.
 * Xid events come from a third per-GPU file, read again at every wait (NVML stays
 * initialised while a device plugin runs, so its state must not wait for a first init):
 *   P/proc/driver/nvidia/gpus/<bus>/xid-events   one Xid (decimal) a line, appended; a
 *                                                line that does not parse is Xid 999
 * An event set registered for Xid events on a GPU remembers how many lines that file had
 * then ("events that occurred before this call are not recorded") and delivers each later
 * line once, in order, GPUs in index order: eventType nvmlEventTypeXidCriticalError (8),
 * eventData the Xid, device the GPU's handle, gpuInstanceId and computeInstanceId
 * 0xFFFFFFFF (a full GPU's). The library only reads the file, so it works read-only.
 * nvmlEventSetWait_v2 (and nvmlEventSetWait, whose data lacks the instance ids) with
 * nothing to deliver looks again every 5 ms and answers 10, Timeout, after timeoutms.
 *
 * Lookups check their arguments first: a NULL pointer, an index >= count or a bus id that
 * does not parse answer 2, Invalid Argument, in every reading; a bus id no GPU has answers
 * 6, Not Found, unless an error above applies.
 *
 * Answers otherwise as NVML: 1 (Uninitialized) before init, nvmlErrorString's texts as
 * the real library's (Debian 550.163.01), nvmlSystemGetDriverVersion = the version suffix
 * of this library's real file name (libnvidia-ml.so.<version>), PCI bus ids in NVML's
 * 8-digit domain form ("00000000:17:00.0", busIdLegacy "0000:17:00.0").
 *
 * What NVIDIA's nvidia-smi (Debian's 550.163.01) calls for `nvidia-smi --version`, the
 * check NVIDIA's DRA driver and GPU Operator validator run against a driver root
 * (tests/test_consumers.py), each answered as Debian's 535.309.01 and 550.163.01 answer
 * it here (ctypes, no GPU) and no looser than nvml.h allows:
 *   nvmlInitWithFlags(0)         as nvmlInit_v2 (flags are not read): 9 without the
 *                                machine's driver; nvmlShutdown 1 (Uninitialized) when
 *                                nothing is initialized, as nvml.h says
 *   nvmlSystemGetNVMLVersion     "<CUDA major>.<driver version>" ("12.550.163.01"), the
 *                                CUDA major of the driver's branch (below 450: 10; below
 *                                525: 11; below 580: 12; else 13); before init too, as the
 *                                header lists no Uninitialized and the real one answers;
 *                                NULL 2, a buffer shorter than the string and its NUL 7
 *   nvmlSystemGetCudaDriverVersion_v2
 *                                1 before init (the real one's answer, NULL or not), NULL
 *                                2; else what cuDriverGetVersion() of the libcuda.so.1
 *                                dlopen finds answers, as the header says: no such library
 *                                12 (Library Not Found), no such function 13 (Function
 *                                Not Found; the tests' simulated libcuda has none), a
 *                                failing call 999
 *   nvmlInternalGetExportTable   NVIDIA's private entry point, in no header: nvidia-smi
 *                                asks it for a table of internal functions by a 16-byte
 *                                UUID (c4fe3e6c-c98f-6c4e-a327-ee696e12f7c4) and answers
 *                                anything but success with "Mismatch in versions between
 *                                nvidia-smi and NVML", exit 255. The real one answers 0
 *                                for that UUID, before init too, with a table whose first
 *                                8 bytes are its size (0x7a8 in 535, 0x7d8 in 550) then
 *                                function pointers, and 2 for an unknown UUID or a NULL
 *                                argument. No private function is simulated: the table
 *                                here is its size field alone (8, no entries), which
 *                                nvidia-smi reads before calling an entry (it calls the
 *                                one at offset 0xd0 only when the size covers it).
 * nvmlSystemGetCudaDriverVersion (no _v2) is not exported: nothing here calls it, and its
 * "known supported version number" when libcuda is missing is not the header's to say.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define NVML_API __attribute__((visibility("default")))

__attribute__((visibility("default"))) const char unb_simulated_nvml[] =
    "unbounded-nvidia-setup simulated NVML";

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_UNKNOWN = 999,
};

#define MAX_GPUS 32
#define MAX_MIG 7
#define GI_PROFILES 18
#define CI_PROFILES 9
#define GIB (1024ULL * 1024ULL * 1024ULL)

/* The per-device queries a GPU's simulated-nvml can fail or block (query-error, hang),
 * by the names the file uses; a versioned entry point answers as its base name. */
enum query {
    Q_UUID, Q_MINOR, Q_PCI, Q_MIG_MODE, Q_NAME, Q_MAX_MIG, Q_MIG_BY_INDEX, Q_ATTRIBUTES,
    Q_CUDA_CC, Q_MEMORY, Q_PARENT, Q_GI_ID, Q_CI_ID, Q_INDEX, Q_IS_MIG, QUERIES
};
static const char *const query_names[QUERIES] = {
    "nvmlDeviceGetUUID", "nvmlDeviceGetMinorNumber", "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetMigMode", "nvmlDeviceGetName", "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetAttributes",
    "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetComputeInstanceId", "nvmlDeviceGetIndex", "nvmlDeviceIsMigDeviceHandle",
};

typedef struct nvmlDevice_st {
    int is_mig;
    unsigned index;               /* NVML index of a GPU; slot of a MIG device */
    struct nvmlDevice_st *parent; /* MIG device: its GPU */
    char uuid[96];
    char name[96];
    char bus[32];                 /* the information file's directory: 0000:17:00.0 */
    unsigned domain, busnum, devnum, func;
    unsigned minor;
    int error;                    /* the code its handle lookups answer; 0: healthy */
    int hang;                     /* its handle lookups block (instead of its error) */
    int query_error[QUERIES];     /* the code each query answers for it; 0: its answer */
    int query_hang[QUERIES];      /* the query blocks for it */
    int mig_enabled;
    int present;                  /* MIG slot in use */
    unsigned gi, ci, gi_profile, ci_profile;
} *nvmlDevice_t;

typedef struct nvmlGpuInstance_st {
    nvmlDevice_t parent;
    unsigned id, profile;
} *nvmlGpuInstance_t;

typedef struct nvmlComputeInstance_st {
    nvmlGpuInstance_t gi;
    unsigned id, profile;
} *nvmlComputeInstance_t;

typedef struct {
    char busIdLegacy[16];
    unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    char busId[16];
    unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
    unsigned reserved0, reserved1, reserved2, reserved3;
} nvmlPciInfo_v1_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned multiprocessorCount, sharedCopyEngineCount, sharedDecoderCount,
        sharedEncoderCount, sharedJpegCount, sharedOfaCount, gpuInstanceSliceCount,
        computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;

typedef struct {
    unsigned id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount,
        copyEngineCount, decoderCount, encoderCount, jpegCount, ofaCount;
    unsigned long long memorySizeMB;
} nvmlGpuInstanceProfileInfo_t;

typedef struct {
    unsigned id, sliceCount, instanceCount, multiprocessorCount, sharedCopyEngineCount,
        sharedDecoderCount, sharedEncoderCount, sharedJpegCount, sharedOfaCount;
} nvmlComputeInstanceProfileInfo_t;

typedef struct {
    unsigned start, size;
} nvmlPlacement_t;

typedef struct {
    nvmlDevice_t device;
    unsigned id, profileId;
    nvmlPlacement_t placement;
} nvmlGpuInstanceInfo_t;

typedef struct {
    nvmlDevice_t device;
    nvmlGpuInstance_t gpuInstance;
    unsigned id, profileId;
    nvmlPlacement_t placement;
} nvmlComputeInstanceInfo_t;

static struct nvmlDevice_st gpus[MAX_GPUS];
static struct nvmlDevice_st migs[MAX_GPUS][MAX_MIG];
static struct nvmlGpuInstance_st gis[MAX_GPUS][MAX_MIG];
static struct nvmlComputeInstance_st cis[MAX_GPUS][MAX_MIG];
static unsigned gpu_count;
enum reading { READ_TARGET, READ_WALK, READ_ANY };
static enum reading reading;
enum devices { DEVICES_UNREAD, DEVICES_SKIP, DEVICES_DENY };
static enum devices devices_reading;
static int refcount;
static int machine_fd = -1; /* O_PATH descriptor of P ("" -> "/") */
static int state_fd = -1;   /* O_PATH descriptor of STATE_DIR, when it exists at load */
static char own_path[PATH_MAX];

#define STATE_DIR "/run/simulated-nvml"

static void anchor(void) {}

/* P from this library's real path: before the first /run/nvidia/ or /run/host-nvidia/. */
static void find_machine(void)
{
    Dl_info info;
    char real[PATH_MAX];
    const char *markers[] = {"/run/nvidia/", "/run/host-nvidia/"};
    char *cut = NULL;
    if (machine_fd >= 0)
        return;
    if (state_fd < 0)
        state_fd = open(STATE_DIR, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (!dladdr((void *)anchor, &info) || info.dli_fname == NULL)
        return;
    if (realpath(info.dli_fname, real) == NULL)
        return;
    snprintf(own_path, sizeof own_path, "%s", real);
    for (size_t i = 0; i < sizeof markers / sizeof markers[0]; i++) {
        char *at = strstr(real, markers[i]);
        if (at != NULL && (cut == NULL || at < cut))
            cut = at;
    }
    if (cut != NULL)
        *cut = '\0';
    machine_fd = open(real[0] && cut != NULL ? real : "/", O_PATH | O_DIRECTORY | O_CLOEXEC);
}

__attribute__((constructor)) static void loaded(void) { find_machine(); }

/* Open a file of the kernel module's, ``rel`` under /proc/driver ("nvidia/gpus/..."):
 * under STATE_DIR when it was there at load, else under P/proc/driver. */
static int open_driver(const char *rel, int flags)
{
    char path[PATH_MAX];
    if (state_fd >= 0)
        return openat(state_fd, rel, flags | O_CLOEXEC);
    snprintf(path, sizeof path, "proc/driver/%s", rel);
    return openat(machine_fd, path, flags | O_CLOEXEC);
}

static int read_driver(const char *rel, char *buf, size_t size)
{
    int fd = open_driver(rel, O_RDONLY);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, size - 1);
    close(fd);
    if (n < 0)
        return -1;
    buf[n] = '\0';
    return (int)n;
}

/* The value after "<key>:" on a line of the information file, trimmed. */
static void field(const char *text, const char *key, char *out, size_t size)
{
    size_t klen = strlen(key);
    out[0] = '\0';
    for (const char *line = text; *line;) {
        size_t len = strcspn(line, "\n");
        if (len > klen && strncmp(line, key, klen) == 0 && line[klen] == ':') {
            const char *v = line + klen + 1;
            size_t n = len - klen - 1;
            while (n > 0 && (*v == ' ' || *v == '\t')) {
                v++;
                n--;
            }
            while (n > 0 && (v[n - 1] == ' ' || v[n - 1] == '\t' || v[n - 1] == '\r'))
                n--;
            if (n >= size)
                n = size - 1;
            memcpy(out, v, n);
            out[n] = '\0';
            return;
        }
        line += len;
        if (*line == '\n')
            line++;
    }
}

static int by_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* GPU instance profile index -> slices (go-nvlib's table; 0 for an unknown one). */
static unsigned gi_slices(unsigned profile)
{
    static const unsigned slices[GI_PROFILES] = {1, 2, 3, 4, 7, 8, 6, 1, 2, 1, 1, 2, 4, 1, 2, 1, 2, 3};
    return profile < GI_PROFILES ? slices[profile] : 0;
}

/* The query a simulated-nvml line names; -1 for a name not in query_names. */
static int query_named(const char *name)
{
    for (int q = 0; q < QUERIES; q++) {
        if (strcmp(query_names[q], name) == 0)
            return q;
    }
    return -1;
}

/* GPU g's simulated-nvml; NVML_ERROR_UNKNOWN for a query-error or hang line that does
 * not name a query of query_names (or lacks a positive code), so a typo fails init. */
static int read_sim_state(nvmlDevice_t gpu, unsigned g)
{
    char path[128], text[8192];
    snprintf(path, sizeof path, "nvidia/gpus/%s/simulated-nvml", gpu->bus);
    if (read_driver(path, text, sizeof text) < 0)
        return NVML_SUCCESS;
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line != NULL;
         line = strtok_r(NULL, "\n", &save)) {
        unsigned slot, gi, ci, gip, cip;
        char uuid[96], name[64], rest;
        int code, q;
        if (strcmp(line, "lost") == 0) {
            gpu->error = NVML_ERROR_GPU_IS_LOST;
        } else if (sscanf(line, "error %d", &code) == 1 && code > 0) {
            gpu->error = code;
        } else if (strncmp(line, "query-error", 11) == 0 && (line[11] == ' ' || !line[11])) {
            if (sscanf(line, "query-error %63s %d %c", name, &code, &rest) != 2 || code <= 0 ||
                (q = query_named(name)) < 0)
                return NVML_ERROR_UNKNOWN;
            gpu->query_error[q] = code;
        } else if (strcmp(line, "hang") == 0) {
            gpu->hang = 1;
        } else if (strncmp(line, "hang ", 5) == 0) {
            if (sscanf(line, "hang %63s %c", name, &rest) != 1 || (q = query_named(name)) < 0)
                return NVML_ERROR_UNKNOWN;
            gpu->query_hang[q] = 1;
        } else if (strcmp(line, "mig") == 0) {
            gpu->mig_enabled = 1;
        } else if (sscanf(line, "mig-device %u %u %u %u %u %95s", &slot, &gi, &ci, &gip, &cip,
                          uuid) == 6 && slot < MAX_MIG) {
            nvmlDevice_t mig = &migs[g][slot];
            mig->is_mig = 1;
            mig->present = 1;
            mig->index = slot;
            mig->parent = gpu;
            mig->gi = gi;
            mig->ci = ci;
            mig->gi_profile = gip;
            mig->ci_profile = cip;
            mig->minor = gpu->minor;
            snprintf(mig->uuid, sizeof mig->uuid, "%s", uuid);
            snprintf(mig->bus, sizeof mig->bus, "%s", gpu->bus);
            snprintf(mig->name, sizeof mig->name, "%s MIG %ug", gpu->name, gi_slices(gip));
        }
    }
    if (!gpu->mig_enabled)
        memset(migs[g], 0, sizeof migs[g]);
    return NVML_SUCCESS;
}

/* One word of a machine-wide file of this simulation's (see the top): the index of the
 * word in `words`, `absent` without the file, -1 for a word this file does not know. */
static int read_word(const char *rel, const char *const words[], int count, int absent)
{
    char text[64];
    if (read_driver(rel, text, sizeof text) < 0)
        return absent;
    text[strcspn(text, " \t\r\n")] = '\0';
    for (int i = 0; i < count; i++)
        if (strcmp(text, words[i]) == 0)
            return i;
    return -1;
}

/* The machine's reading of the header (see the top); a word this file does not know
 * fails init rather than pass for "target", so a typo in a test cannot weaken it. */
static int read_reading(void)
{
    static const char *const words[] = {"target", "walk", "any"}; /* enum reading's order */
    int word = read_word("nvidia/simulated-nvml-reading", words, 3, READ_TARGET);
    reading = word < 0 ? READ_TARGET : (enum reading)word;
    return word < 0 ? NVML_ERROR_UNKNOWN : NVML_SUCCESS;
}

/* The machine's reading of GPU device nodes (see the top): absent, nodes are not looked
 * at; a word this file does not know fails init, as for the reading above. */
static int read_devices(void)
{
    static const char *const words[] = {"skip", "deny"};
    int word = read_word("nvidia/simulated-nvml-devices", words, 2, -2);
    devices_reading = word == 0 ? DEVICES_SKIP : word == 1 ? DEVICES_DENY : DEVICES_UNREAD;
    return word == -1 ? NVML_ERROR_UNKNOWN : NVML_SUCCESS;
}

/* Whether P/dev/nvidia<minor> is a character device (a container's own /dev: P = ""). */
static int has_node(unsigned minor)
{
    char node[32];
    struct stat st;
    snprintf(node, sizeof node, "dev/nvidia%u", minor);
    return fstatat(machine_fd, node, &st, 0) == 0 && S_ISCHR(st.st_mode);
}

/* The machine's GPUs now; NVML_SUCCESS, NVML_ERROR_DRIVER_NOT_LOADED, or
 * NVML_ERROR_UNKNOWN for a reading this file does not know. */
static int load_machine(void)
{
    struct stat st;
    char *names[MAX_GPUS * 4];
    unsigned n = 0;
    find_machine();
    memset(gpus, 0, sizeof gpus);
    memset(migs, 0, sizeof migs);
    memset(gis, 0, sizeof gis);
    memset(cis, 0, sizeof cis);
    gpu_count = 0;
    if (machine_fd < 0)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    if (fstatat(machine_fd, "dev/nvidiactl", &st, 0) != 0 || !S_ISCHR(st.st_mode))
        return NVML_ERROR_DRIVER_NOT_LOADED;
    if (read_reading() != NVML_SUCCESS || read_devices() != NVML_SUCCESS)
        return NVML_ERROR_UNKNOWN;
    int dfd = open_driver("nvidia/gpus", O_RDONLY | O_DIRECTORY);
    if (dfd < 0)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    DIR *dir = fdopendir(dfd);
    if (dir == NULL) {
        close(dfd);
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    for (struct dirent *e; (e = readdir(dir)) != NULL && n < MAX_GPUS * 4;) {
        if (e->d_name[0] != '.')
            names[n++] = strdup(e->d_name);
    }
    closedir(dir);
    qsort(names, n, sizeof names[0], by_name);
    int ret = NVML_SUCCESS;
    for (unsigned i = 0; i < n; i++) {
        char path[PATH_MAX], text[8192], uuid[96], minor[32], model[96], excluded[16];
        snprintf(path, sizeof path, "nvidia/gpus/%s/information", names[i]);
        if (gpu_count < MAX_GPUS && strlen(names[i]) < sizeof gpus[0].bus &&
            read_driver(path, text, sizeof text) >= 0) {
            field(text, "GPU UUID", uuid, sizeof uuid);
            field(text, "Device Minor", minor, sizeof minor);
            field(text, "Model", model, sizeof model);
            field(text, "GPU Excluded", excluded, sizeof excluded);
            /* An excluded GPU's UUID line still starts with "GPU-" (question marks
             * follow): the flag, not the UUID, is what keeps it out of NVML. */
            int enumerated = strcasecmp(excluded, "Yes") != 0 && strncmp(uuid, "GPU-", 4) == 0 &&
                             minor[0] && strspn(minor, "0123456789") == strlen(minor);
            unsigned number = enumerated ? (unsigned)strtoul(minor, NULL, 10) : 0;
            int node = enumerated && (devices_reading == DEVICES_UNREAD || has_node(number));
            if (enumerated && (node || devices_reading != DEVICES_SKIP)) {
                nvmlDevice_t gpu = &gpus[gpu_count];
                gpu->index = gpu_count;
                snprintf(gpu->uuid, sizeof gpu->uuid, "%s", uuid);
                snprintf(gpu->name, sizeof gpu->name, "%s", model[0] ? model : "NVIDIA GPU");
                snprintf(gpu->bus, sizeof gpu->bus, "%s", names[i]);
                gpu->minor = number;
                if (sscanf(names[i], "%x:%x:%x.%x", &gpu->domain, &gpu->busnum, &gpu->devnum,
                           &gpu->func) != 4)
                    gpu->domain = gpu->busnum = gpu->devnum = gpu->func = 0;
                if (read_sim_state(gpu, gpu_count) != NVML_SUCCESS)
                    ret = NVML_ERROR_UNKNOWN;
                if (!node) { /* deny: NVML cannot open the GPU's node */
                    gpu->error = NVML_ERROR_NO_PERMISSION;
                    gpu->hang = 0;
                }
                gpu_count++;
            }
        }
        free(names[i]);
    }
    if (ret != NVML_SUCCESS)
        return ret;
    return gpu_count ? NVML_SUCCESS : NVML_ERROR_DRIVER_NOT_LOADED;
}

static int valid(nvmlDevice_t d)
{
    if (d == NULL)
        return 0;
    if (d >= &gpus[0] && d < &gpus[gpu_count])
        return 1;
    return d >= &migs[0][0] && d < &migs[MAX_GPUS][0] && d->present;
}

static unsigned gpu_slot(nvmlDevice_t gpu) { return (unsigned)(gpu - &gpus[0]); }

static int copy_out(const char *value, char *buf, unsigned length)
{
    if (buf == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(value) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buf, value, strlen(value) + 1);
    return NVML_SUCCESS;
}

#define NEEDS_INIT()                                                                       \
    do {                                                                                   \
        if (refcount == 0)                                                                 \
            return NVML_ERROR_UNINITIALIZED;                                               \
    } while (0)

#define NEEDS_DEVICE(d)                                                                    \
    do {                                                                                   \
        NEEDS_INIT();                                                                      \
        if (!valid(d))                                                                     \
            return NVML_ERROR_INVALID_ARGUMENT;                                            \
    } while (0)

/* A GPU whose GSP stopped answering: the call never returns. It sleeps, signals left
 * as they are, so the caller's SIGTERM or SIGKILL ends it. */
__attribute__((noreturn)) static void block(void)
{
    for (;;) {
        struct timespec pause = {1, 0};
        nanosleep(&pause, NULL);
    }
}

/* What a per-device query answers for a handle before its own answer: its GPU's
 * query-error for it, or never (hang). A MIG device's handle stands for its GPU. */
static int query(nvmlDevice_t d, enum query q)
{
    nvmlDevice_t gpu = d->is_mig ? d->parent : d;
    if (gpu->query_hang[q])
        block();
    return gpu->query_error[q];
}

#define QUERY(d, q)                                                                        \
    do {                                                                                   \
        int query_ret = query(d, q);                                                       \
        if (query_ret != NVML_SUCCESS)                                                     \
            return query_ret;                                                              \
    } while (0)

/* ---------------------------------------------------------------- init, shutdown */

NVML_API int nvmlInit_v2(void)
{
    if (refcount == 0) {
        int ret = load_machine();
        if (ret != NVML_SUCCESS)
            return ret;
    }
    refcount++;
    return NVML_SUCCESS;
}

NVML_API int nvmlInit(void) { return nvmlInit_v2(); }

NVML_API int nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    return nvmlInit_v2();
}

NVML_API int nvmlShutdown(void)
{
    /* nvml.h: NVML_ERROR_UNINITIALIZED if the library has not been successfully
     * initialized (the real one answers 0 here; the header's reading is the stricter). */
    if (refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    refcount--;
    return NVML_SUCCESS;
}

NVML_API const char *nvmlErrorString(int result)
{
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt Request Issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires reset";
    case 17: return "GPU access blocked by the operating system";
    case 18: return "Driver/library version mismatch";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case 22: return "vGPU ECC not supported";
    case 23: return "Insufficient Resources";
    case 24: return "Invalid Frequency";
    case 25: return "Argument version mismatch";
    case 26: return "Requested functionality has been deprecated";
    case 27: return "System is not in ready state";
    case 28: return "No supported GPUs were found";
    case 29: return "Resource not in correct state to perform requested operation";
    default: return "Unknown Error";
    }
}

/* The driver version this library stands for: the version suffix of its real file
 * name (libnvidia-ml.so.<version>; digits and dots, at least one dot, not starting or
 * ending with one, no two in a row), or NULL. */
static const char *own_version(void)
{
    const char *prefix = "libnvidia-ml.so.";
    const char *base = strrchr(own_path, '/');
    base = base ? base + 1 : own_path;
    if (strncmp(base, prefix, strlen(prefix)) != 0)
        return NULL;
    const char *ver = base + strlen(prefix);
    int dots = 0;
    if (!isdigit((unsigned char)ver[0]) || !isdigit((unsigned char)ver[strlen(ver) - 1]))
        return NULL;
    for (const char *c = ver; *c; c++) {
        if (*c == '.') {
            if (c[1] == '.')
                return NULL;
            dots++;
        } else if (!isdigit((unsigned char)*c)) {
            return NULL;
        }
    }
    return dots ? ver : NULL;
}

NVML_API int nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    NEEDS_INIT();
    const char *ver = own_version();
    if (ver == NULL)
        return NVML_ERROR_UNKNOWN;
    return copy_out(ver, version, length);
}

/* "<CUDA major>.<driver version>": the CUDA major version the driver's branch ships
 * with (450 brought CUDA 11, 525 CUDA 12, 580 CUDA 13). No init needed. */
NVML_API int nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    char text[96];
    if (version == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    const char *ver = own_version();
    if (ver == NULL)
        return NVML_ERROR_UNKNOWN;
    unsigned long branch = strtoul(ver, NULL, 10);
    int cuda = branch < 450 ? 10 : branch < 525 ? 11 : branch < 580 ? 12 : 13;
    if (snprintf(text, sizeof text, "%d.%s", cuda, ver) >= (int)sizeof text)
        return NVML_ERROR_UNKNOWN;
    return copy_out(text, version, length);
}

/* cuDriverGetVersion() of the libcuda.so.1 the dynamic linker finds, as the header says. */
NVML_API int nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    NEEDS_INIT();
    if (cudaDriverVersion == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (cuda == NULL)
        return NVML_ERROR_LIBRARY_NOT_FOUND;
    int (*get)(int *) = (int (*)(int *))dlsym(cuda, "cuDriverGetVersion");
    int ret = NVML_ERROR_FUNCTION_NOT_FOUND, value = 0;
    if (get != NULL)
        ret = get(&value) == 0 ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
    dlclose(cuda);
    if (ret == NVML_SUCCESS)
        *cudaDriverVersion = value;
    return ret;
}

/* NVIDIA's private table lookup (see the top of this file): the one table nvidia-smi
 * asks for, holding no entry. */
static const unsigned char smi_table_uuid[16] = {
    0xc4, 0xfe, 0x3e, 0x6c, 0xc9, 0x8f, 0x6c, 0x4e,
    0xa3, 0x27, 0xee, 0x69, 0x6e, 0x12, 0xf7, 0xc4,
};
static const unsigned long long smi_table[1] = {sizeof smi_table};

NVML_API int nvmlInternalGetExportTable(const void **table, const unsigned char *uuid)
{
    if (table == NULL || uuid == NULL || memcmp(uuid, smi_table_uuid, sizeof smi_table_uuid))
        return NVML_ERROR_INVALID_ARGUMENT;
    *table = smi_table;
    return NVML_SUCCESS;
}

/* ---------------------------------------------------------------- device handles */

NVML_API int nvmlDeviceGetCount_v2(unsigned int *count)
{
    NEEDS_INIT();
    if (count == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = gpu_count;
    return NVML_SUCCESS;
}

NVML_API int nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

/* What GPU g's lookups meet: HANG for a GPU that blocks them, else its error (0: none). */
#define HANG (-1)
static int fault(unsigned g) { return gpus[g].hang ? HANG : gpus[g].error; }

/* A lookup's answer: HANG blocks it. */
static int answer(int ret)
{
    if (ret == HANG)
        block();
    return ret;
}

/* The code every lookup answers in walk and any: the first GPU's with 8 or 11 (the
 * header's "any attached devices"); 0 where none has one or in target. */
static int machine_error(void)
{
    if (reading == READ_TARGET)
        return NVML_SUCCESS;
    for (unsigned g = 0; g < gpu_count; g++) {
        if (fault(g) == NVML_ERROR_INSUFFICIENT_POWER || fault(g) == NVML_ERROR_IRQ_ISSUE)
            return fault(g);
    }
    return NVML_SUCCESS;
}

/* What a lookup of GPU g by index or by PCI bus id answers (see the top's table);
 * blocks for a GPU that hangs. */
static int target_error(unsigned g)
{
    int ret = machine_error();
    return answer(ret != NVML_SUCCESS ? ret : fault(g));
}

NVML_API int nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    NEEDS_INIT();
    if (device == NULL || index >= gpu_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    int ret = target_error(index);
    if (ret != NVML_SUCCESS)
        return ret;
    *device = &gpus[index];
    return NVML_SUCCESS;
}

NVML_API int nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

/* GPU g itself, or its MIG device with this uuid; NULL when neither has it. */
static nvmlDevice_t uuid_on(unsigned g, const char *uuid)
{
    if (strcmp(gpus[g].uuid, uuid) == 0)
        return &gpus[g];
    for (unsigned j = 0; j < MAX_MIG; j++) {
        if (migs[g][j].present && strcmp(migs[g][j].uuid, uuid) == 0)
            return &migs[g][j];
    }
    return NULL;
}

NVML_API int nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    NEEDS_INIT();
    if (uuid == NULL || device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    int ret = machine_error();
    if (ret != NVML_SUCCESS)
        return ret;
    if (reading == READ_ANY) {
        for (unsigned g = 0; g < gpu_count; g++) {
            if (fault(g) != NVML_SUCCESS)
                return answer(fault(g));
        }
    }
    /* walk: the search initialises GPUs in index order and stops at the first that
     * fails, before it could reach a target further on. */
    for (unsigned g = 0; g < gpu_count; g++) {
        if (reading == READ_WALK && fault(g) != NVML_SUCCESS)
            return answer(fault(g));
        nvmlDevice_t found = uuid_on(g, uuid);
        if (found != NULL) {
            if (fault(g) != NVML_SUCCESS)
                return answer(fault(g));
            *device = found;
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

/* "00000000:17:00.0", "0000:17:00.0" or "17:00.0" -> domain, bus, device, function */
static int parse_bus(const char *text, unsigned *dom, unsigned *bus, unsigned *dev, unsigned *fn)
{
    if (sscanf(text, "%x:%x:%x.%x", dom, bus, dev, fn) == 4)
        return 1;
    *dom = 0;
    return sscanf(text, "%x:%x.%x", bus, dev, fn) == 3;
}

NVML_API int nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    unsigned dom, bus, dev, fn;
    NEEDS_INIT();
    if (pciBusId == NULL || device == NULL || !parse_bus(pciBusId, &dom, &bus, &dev, &fn))
        return NVML_ERROR_INVALID_ARGUMENT;
    int ret = machine_error();
    if (ret != NVML_SUCCESS)
        return ret;
    for (unsigned g = 0; g < gpu_count; g++) {
        nvmlDevice_t gpu = &gpus[g];
        if (gpu->domain == dom && gpu->busnum == bus && gpu->devnum == dev && gpu->func == fn) {
            if (fault(g) != NVML_SUCCESS)
                return answer(fault(g));
            *device = gpu;
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

NVML_API int nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
}

/* ---------------------------------------------------------------- device queries */

NVML_API int nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    NEEDS_DEVICE(device);
    if (uuid == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    QUERY(device, Q_UUID);
    return copy_out(device->uuid, uuid, length);
}

NVML_API int nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    NEEDS_DEVICE(device);
    if (name == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    QUERY(device, Q_NAME);
    return copy_out(device->name, name, length);
}

NVML_API int nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor)
{
    NEEDS_DEVICE(device);
    if (minor == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    QUERY(device, Q_MINOR);
    if (device->is_mig)
        return NVML_ERROR_NOT_SUPPORTED;
    *minor = device->minor;
    return NVML_SUCCESS;
}

NVML_API int nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    NEEDS_DEVICE(device);
    if (index == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    QUERY(device, Q_INDEX);
    *index = device->index;
    return NVML_SUCCESS;
}

static void pci_fields(nvmlDevice_t device, char *legacy, size_t legacy_size, char *busid,
                       size_t busid_size, unsigned *domain, unsigned *bus, unsigned *dev,
                       unsigned *devid, unsigned *subsys)
{
    nvmlDevice_t gpu = device->is_mig ? device->parent : device;
    snprintf(legacy, legacy_size, "%04x:%02x:%02x.%x", gpu->domain, gpu->busnum, gpu->devnum,
             gpu->func);
    if (busid != NULL)
        snprintf(busid, busid_size, "%08x:%02x:%02x.%x", gpu->domain, gpu->busnum,
                 gpu->devnum, gpu->func);
    *domain = gpu->domain;
    *bus = gpu->busnum;
    *dev = gpu->devnum;
    *devid = 0x233010DE;  /* H100 SXM5 80GB */
    *subsys = 0x16C110DE;
}

NVML_API int nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    NEEDS_DEVICE(device);
    if (pci == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    QUERY(device, Q_PCI);
    memset(pci, 0, sizeof *pci);
    pci_fields(device, pci->busIdLegacy, sizeof pci->busIdLegacy, pci->busId, sizeof pci->busId,
               &pci->domain, &pci->bus, &pci->device, &pci->pciDeviceId, &pci->pciSubSystemId);
    return NVML_SUCCESS;
}

NVML_API int nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

NVML_API int nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_v1_t *pci)
{
    NEEDS_DEVICE(device);
    if (pci == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    QUERY(device, Q_PCI);
    memset(pci, 0, sizeof *pci);
    pci_fields(device, pci->busId, sizeof pci->busId, NULL, 0, &pci->domain, &pci->bus,
               &pci->device, &pci->pciDeviceId, &pci->pciSubSystemId);
    return NVML_SUCCESS;
}

NVML_API int nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    NEEDS_DEVICE(device);
    if (memory == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    QUERY(device, Q_MEMORY);
    memory->total = device->is_mig ? 10 * GIB : 80 * GIB;
    memory->used = 1 * GIB / 2;
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

NVML_API int nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes)
{
    NEEDS_DEVICE(device);
    if (attributes == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    QUERY(device, Q_ATTRIBUTES);
    memset(attributes, 0, sizeof *attributes);
    unsigned slices = device->is_mig ? gi_slices(device->gi_profile) : 7;
    if (slices == 0)
        slices = 1;
    attributes->multiprocessorCount = 16 * slices;
    attributes->sharedCopyEngineCount = slices;
    attributes->sharedDecoderCount = slices;
    attributes->gpuInstanceSliceCount = slices;
    attributes->computeInstanceSliceCount = slices;
    /* 1g.10gb of an H100 80GB: 9856 MB; the whole GPU: 81559 MB */
    attributes->memorySizeMB = device->is_mig ? 9856ULL * slices : 81559ULL;
    return NVML_SUCCESS;
}

NVML_API int nvmlDeviceGetAttributes(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes)
{
    return nvmlDeviceGetAttributes_v2(device, attributes);
}

/* ---------------------------------------------------------------- MIG */

NVML_API int nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending)
{
    NEEDS_DEVICE(device);
    if (current == NULL || pending == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    QUERY(device, Q_MIG_MODE);
    if (device->is_mig)
        return NVML_ERROR_NOT_SUPPORTED;
    *current = *pending = device->mig_enabled ? 1 : 0;
    return NVML_SUCCESS;
}

NVML_API int nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    NEEDS_DEVICE(device);
    if (count == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    QUERY(device, Q_MAX_MIG);
    if (device->is_mig)
        return NVML_ERROR_NOT_SUPPORTED;
    *count = MAX_MIG;
    return NVML_SUCCESS;
}

NVML_API int nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                 nvmlDevice_t *mig)
{
    NEEDS_DEVICE(device);
    if (mig == NULL || device->is_mig || index >= MAX_MIG)
        return NVML_ERROR_INVALID_ARGUMENT;
    QUERY(device, Q_MIG_BY_INDEX);
    nvmlDevice_t found = &migs[gpu_slot(device)][index];
    if (!device->mig_enabled || !found->present)
        return NVML_ERROR_NOT_FOUND;
    *mig = found;
    return NVML_SUCCESS;
}

NVML_API int nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
    NEEDS_DEVICE(device);
    if (isMigDevice == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    QUERY(device, Q_IS_MIG);
    *isMigDevice = device->is_mig ? 1 : 0;
    return NVML_SUCCESS;
}

NVML_API int nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t mig, nvmlDevice_t *device)
{
    NEEDS_DEVICE(mig);
    if (device == NULL || !mig->is_mig)
        return NVML_ERROR_INVALID_ARGUMENT;
    QUERY(mig, Q_PARENT);
    *device = mig->parent;
    return NVML_SUCCESS;
}

NVML_API int nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    NEEDS_DEVICE(device);
    if (id == NULL || !device->is_mig)
        return NVML_ERROR_INVALID_ARGUMENT;
    QUERY(device, Q_GI_ID);
    *id = device->gi;
    return NVML_SUCCESS;
}

NVML_API int nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    NEEDS_DEVICE(device);
    if (id == NULL || !device->is_mig)
        return NVML_ERROR_INVALID_ARGUMENT;
    QUERY(device, Q_CI_ID);
    *id = device->ci;
    return NVML_SUCCESS;
}

NVML_API int nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id,
                                          nvmlGpuInstance_t *gpuInstance)
{
    NEEDS_DEVICE(device);
    if (gpuInstance == NULL || device->is_mig)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!device->mig_enabled)
        return NVML_ERROR_NOT_SUPPORTED;
    unsigned g = gpu_slot(device);
    for (unsigned j = 0; j < MAX_MIG; j++) {
        if (migs[g][j].present && migs[g][j].gi == id) {
            gis[g][j].parent = device;
            gis[g][j].id = id;
            gis[g][j].profile = migs[g][j].gi_profile;
            *gpuInstance = &gis[g][j];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

static int valid_gi(nvmlGpuInstance_t gi)
{
    return refcount > 0 && gi != NULL && gi >= &gis[0][0] && gi < &gis[MAX_GPUS][0] &&
           gi->parent != NULL;
}

static int valid_ci(nvmlComputeInstance_t ci)
{
    return refcount > 0 && ci != NULL && ci >= &cis[0][0] && ci < &cis[MAX_GPUS][0] &&
           ci->gi != NULL;
}

NVML_API int nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
                                                 nvmlGpuInstanceProfileInfo_t *info)
{
    NEEDS_DEVICE(device);
    if (info == NULL || device->is_mig || profile >= GI_PROFILES)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(info, 0, sizeof *info);
    info->id = profile;
    info->sliceCount = gi_slices(profile);
    info->instanceCount = 7 / (info->sliceCount ? info->sliceCount : 1);
    info->multiprocessorCount = 16 * info->sliceCount;
    info->copyEngineCount = info->sliceCount;
    info->memorySizeMB = 9856ULL * info->sliceCount;
    return NVML_SUCCESS;
}

NVML_API int nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info)
{
    if (refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    if (!valid_gi(gpuInstance) || info == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(info, 0, sizeof *info);
    info->device = gpuInstance->parent;
    info->id = gpuInstance->id;
    info->profileId = gpuInstance->profile;
    info->placement.size = gi_slices(gpuInstance->profile);
    return NVML_SUCCESS;
}

NVML_API int nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t gpuInstance, unsigned int id,
                                                   nvmlComputeInstance_t *computeInstance)
{
    if (refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    if (!valid_gi(gpuInstance) || computeInstance == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned g = gpu_slot(gpuInstance->parent);
    for (unsigned j = 0; j < MAX_MIG; j++) {
        nvmlDevice_t mig = &migs[g][j];
        if (mig->present && mig->gi == gpuInstance->id && mig->ci == id) {
            cis[g][j].gi = gpuInstance;
            cis[g][j].id = id;
            cis[g][j].profile = mig->ci_profile;
            *computeInstance = &cis[g][j];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

NVML_API int nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t gpuInstance,
                                                          unsigned int profile,
                                                          unsigned int engProfile,
                                                          nvmlComputeInstanceProfileInfo_t *info)
{
    static const unsigned slices[CI_PROFILES] = {1, 2, 3, 4, 7, 8, 6, 1, 7};
    if (refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    if (!valid_gi(gpuInstance) || info == NULL || profile >= CI_PROFILES || engProfile != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(info, 0, sizeof *info);
    info->id = profile;
    info->sliceCount = slices[profile];
    info->instanceCount = 1;
    info->multiprocessorCount = 16 * slices[profile];
    return NVML_SUCCESS;
}

NVML_API int nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance,
                                           nvmlComputeInstanceInfo_t *info)
{
    if (refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    if (!valid_ci(computeInstance) || info == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(info, 0, sizeof *info);
    info->device = computeInstance->gi->parent;
    info->gpuInstance = computeInstance->gi;
    info->id = computeInstance->id;
    info->profileId = computeInstance->profile;
    return NVML_SUCCESS;
}

NVML_API int nvmlComputeInstanceGetInfo(nvmlComputeInstance_t computeInstance,
                                        nvmlComputeInstanceInfo_t *info)
{
    return nvmlComputeInstanceGetInfo_v2(computeInstance, info);
}

/* ---------------------------------------------------------------- CUDA */

NVML_API int nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    NEEDS_DEVICE(device);
    if (major == NULL || minor == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    QUERY(device, Q_CUDA_CC);
    *major = 9; /* H100: sm_90 */
    *minor = 0;
    return NVML_SUCCESS;
}

/* ---------------------------------------------------------------- topology, NVLink */

/* nvmlGpuTopologyLevel_t: every pair of this machine's GPUs is joined through the
 * system (NVML_TOPOLOGY_SYSTEM): no NVLink, no common PCIe switch. The device plugin's
 * GetPreferredAllocation asks this for each pair. */
#define TOPOLOGY_INTERNAL 0
#define TOPOLOGY_SYSTEM 50
#define NVLINK_MAX_LINKS 18 /* NVML_NVLINK_MAX_LINKS */

NVML_API int nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                 int *pathInfo)
{
    NEEDS_DEVICE(device1);
    if (!valid(device2) || pathInfo == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (device1->is_mig || device2->is_mig)
        return NVML_ERROR_NOT_SUPPORTED;
    *pathInfo = device1 == device2 ? TOPOLOGY_INTERNAL : TOPOLOGY_SYSTEM;
    return NVML_SUCCESS;
}

/* No NVLink on these GPUs: a link's state is Not Supported (what NVML answers for a
 * link a GPU does not have), a link number past the maximum an invalid argument. */
NVML_API int nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, int *isActive)
{
    NEEDS_DEVICE(device);
    if (isActive == NULL || link >= NVLINK_MAX_LINKS)
        return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_ERROR_NOT_SUPPORTED;
}

/* ---------------------------------------------------------------- events */

#define EVENT_SINGLE_BIT_ECC 0x1ULL
#define EVENT_DOUBLE_BIT_ECC 0x2ULL
#define EVENT_PSTATE 0x4ULL
#define EVENT_XID 0x8ULL
#define EVENT_MIG_CONFIG 0x100ULL
#define EVENT_ALL 0xFF9FULL /* nvmlEventTypeAll */
/* What an H100 supports here (nvmlDeviceGetSupportedEventTypes). */
#define EVENT_SUPPORTED (EVENT_SINGLE_BIT_ECC | EVENT_DOUBLE_BIT_ECC | EVENT_PSTATE | EVENT_XID | \
                         EVENT_MIG_CONFIG)
#define MAX_SETS 64
#define NO_INSTANCE 0xFFFFFFFFU
#define POLL_NS 5000000L /* 5 ms between looks at the xid-events files */

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
} nvmlEventData_v1_t;

typedef struct nvmlEventSet_st {
    int used;
    unsigned long long mask[MAX_GPUS]; /* registered types, by GPU slot */
    char bus[MAX_GPUS][32];            /* the GPU's directory when it registered */
    unsigned seen[MAX_GPUS];           /* its xid-events lines already past */
} *nvmlEventSet_t;

static struct nvmlEventSet_st sets[MAX_SETS];

static int valid_set(nvmlEventSet_t set)
{
    return set != NULL && set >= &sets[0] && set < &sets[MAX_SETS] && set->used;
}

/* The Xids in nvidia/gpus/<bus>/xid-events, one decimal a line, in order; the count
 * read, at most max (a line that does not parse counts, as 999: an unknown Xid). */
static unsigned read_xids(const char *bus, unsigned long long *xids, unsigned max)
{
    char path[128], text[16384];
    unsigned n = 0;
    snprintf(path, sizeof path, "nvidia/gpus/%s/xid-events", bus);
    if (read_driver(path, text, sizeof text) < 0)
        return 0;
    for (char *line = text; *line && n < max;) {
        size_t len = strcspn(line, "\n");
        if (line[len] != '\n')
            break; /* a line still being written */
        char *end;
        unsigned long long xid = strtoull(line, &end, 10);
        xids[n++] = end == line ? 999 : xid;
        line += len + 1;
    }
    return n;
}

NVML_API int nvmlEventSetCreate(nvmlEventSet_t *set)
{
    NEEDS_INIT();
    if (set == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < MAX_SETS; i++) {
        if (!sets[i].used) {
            memset(&sets[i], 0, sizeof sets[i]);
            sets[i].used = 1;
            *set = &sets[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_UNKNOWN;
}

NVML_API int nvmlEventSetFree(nvmlEventSet_t set)
{
    NEEDS_INIT();
    if (!valid_set(set))
        return NVML_ERROR_UNKNOWN;
    set->used = 0;
    return NVML_SUCCESS;
}

NVML_API int nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
{
    NEEDS_DEVICE(device);
    if (eventTypes == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlDevice_t gpu = device->is_mig ? device->parent : device;
    int ret = target_error(gpu_slot(gpu));
    if (ret != NVML_SUCCESS)
        return ret;
    *eventTypes = EVENT_SUPPORTED;
    return NVML_SUCCESS;
}

NVML_API int nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                      nvmlEventSet_t set)
{
    NEEDS_DEVICE(device);
    if (!valid_set(set) || (eventTypes & ~EVENT_ALL) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlDevice_t gpu = device->is_mig ? device->parent : device;
    unsigned g = gpu_slot(gpu);
    int ret = target_error(g);
    if (ret != NVML_SUCCESS)
        return ret;
    if ((eventTypes & ~EVENT_SUPPORTED) != 0)
        return NVML_ERROR_NOT_SUPPORTED; /* none of them is registered */
    if ((eventTypes & EVENT_XID) && !(set->mask[g] & EVENT_XID)) {
        /* "All events that occurred before this call are not recorded." */
        unsigned long long xids[1024];
        snprintf(set->bus[g], sizeof set->bus[g], "%s", gpu->bus);
        set->seen[g] = read_xids(gpu->bus, xids, 1024);
    }
    set->mask[g] |= eventTypes;
    return NVML_SUCCESS;
}

/* The next Xid recorded for the set, if any: the GPU's handle and the Xid. */
static int next_xid(nvmlEventSet_t set, nvmlDevice_t *device, unsigned long long *xid)
{
    for (unsigned g = 0; g < MAX_GPUS; g++) {
        unsigned long long xids[1024];
        if (!(set->mask[g] & EVENT_XID))
            continue;
        unsigned n = read_xids(set->bus[g], xids, 1024);
        if (n > set->seen[g]) {
            *xid = xids[set->seen[g]++];
            *device = &gpus[g];
            return 1;
        }
    }
    return 0;
}

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int wait_event(nvmlEventSet_t set, nvmlEventData_t *data, unsigned timeoutms)
{
    NEEDS_INIT();
    if (data == NULL || !valid_set(set))
        return NVML_ERROR_INVALID_ARGUMENT;
    long long deadline = now_ns() + (long long)timeoutms * 1000000LL;
    for (;;) {
        nvmlDevice_t device;
        unsigned long long xid;
        if (next_xid(set, &device, &xid)) {
            data->device = device;
            data->eventType = EVENT_XID;
            data->eventData = xid;
            data->gpuInstanceId = NO_INSTANCE;
            data->computeInstanceId = NO_INSTANCE;
            return NVML_SUCCESS;
        }
        long long left = deadline - now_ns();
        if (left <= 0)
            return NVML_ERROR_TIMEOUT;
        struct timespec pause = {0, left < POLL_NS ? left : POLL_NS};
        nanosleep(&pause, NULL);
    }
}

NVML_API int nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return wait_event(set, data, timeoutms);
}

NVML_API int nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_v1_t *data, unsigned int timeoutms)
{
    nvmlEventData_t full;
    if (data == NULL)
        return wait_event(set, NULL, timeoutms);
    int ret = wait_event(set, &full, timeoutms);
    if (ret == NVML_SUCCESS) {
        data->device = full.device;
        data->eventType = full.eventType;
        data->eventData = full.eventData;
    }
    return ret;
}
