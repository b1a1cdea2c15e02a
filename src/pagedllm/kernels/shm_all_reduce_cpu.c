/* Sum all-reduce of float32 tensors between the ranks of a tensor-parallel group on one host, through one
 * shared-memory segment every rank has mapped (distributed/shm_communicator.py creates the segment; this file
 * only reads and writes it through the base address it is given).
 *
 * Segment layout (R ranks, S = slot_floats):
 *   R control lines of 64 bytes   rank r's: seq (all-reduce chunks whose data r has published; wraps),
 *                                 waiters (peers asleep on seq), pid
 *   R x 2 slots of S floats       rank r's slots 2r and 2r + 1 (a double buffer: chunk number n uses n % 2)
 *
 * One chunk of at most S floats, n = this rank's seq + 1:
 *   1. copy the chunk into my slot n % 2, publish seq = n, wake the peers asleep on my seq;
 *   2. wait until every peer's seq has reached n: their chunks are in their slots n % 2;
 *   3. out = slot(0) + slot(1) + ... + slot(R - 1), in rank order, one separate pass per rank.
 * Every rank adds the same floats in the same order, so every rank ends with the same bits, whichever rank it
 * is (vLLM's shm all-reduce starts each rank's sum at its own data: at 3 ranks or more, ranks differ in the
 * last bits). A tensor larger than S floats is several chunks, one after the other.
 *
 * Why one wait per chunk is enough: slot n % 2 is written again by chunk n + 2 only. A rank starting chunk
 * n + 2 has finished chunk n + 1, so it has seen every peer publish n + 1, and a peer publishes n + 1 only
 * after it has finished reading the slots of chunk n.
 *
 * Waiting: spin for SPIN_NS (ranks usually arrive within microseconds of each other), then sleep on the
 * peer's seq word (a futex on the shared page; the publisher makes the wake-up system call only when its
 * waiters count says someone sleeps). Every SLEEP_NS a sleeper checks that the peer's process still exists and
 * is not a zombie: a dead peer ends the all-reduce with its rank + 1 as the result (the caller raises), never a
 * hang.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#define LINE_BYTES 64
#define SPIN_NS 50000LL
#define SLEEP_NS 100000000LL
#define SUM_BLOCK_FLOATS 4096 /* 16 KiB: the output block stays in L1 while every rank's slot is added */

typedef struct {
    uint32_t seq;
    uint32_t waiters;
    int64_t pid;
    char pad[LINE_BYTES - 16];
} rank_line;

_Static_assert(sizeof(rank_line) == LINE_BYTES, "one control line per cache line");

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* seq has reached target, modulo 2^32. */
static inline int reached(uint32_t seq, uint32_t target)
{
    return (int32_t)(seq - target) >= 0;
}

static void sleep_on(uint32_t *word, uint32_t seen)
{
#ifdef __linux__
    struct timespec timeout = {0, SLEEP_NS};
    syscall(SYS_futex, word, FUTEX_WAIT, seen, &timeout, NULL, 0); /* returns at once if *word != seen */
#else
    (void)word;
    (void)seen;
    struct timespec pause = {0, 20000};
    nanosleep(&pause, NULL);
#endif
}

static void wake_all(uint32_t *word)
{
#ifdef __linux__
    syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
#else
    (void)word;
#endif
}

/* Whether process pid has exited: gone, or a zombie its parent has not reaped yet (kill() still reaches those). */
static int process_gone(pid_t pid)
{
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return 1;
#ifdef __linux__
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return 0;
    const size_t len = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[len] = 0;
    const char *end_of_name = strrchr(buf, ')'); /* "pid (name) S ...": the name may hold spaces */
    if (end_of_name != NULL && end_of_name[1] == ' ' && (end_of_name[2] == 'Z' || end_of_name[2] == 'X'))
        return 1;
#endif
    return 0;
}

/* 0 once peer's seq reaches target; -1 if the peer's process is gone. */
static int wait_for(rank_line *peer, uint32_t target)
{
    const int64_t start = now_ns();
    for (uint32_t i = 1;; i++) {
        if (reached(__atomic_load_n(&peer->seq, __ATOMIC_ACQUIRE), target))
            return 0;
        cpu_relax();
        if ((i & 255) == 0 && now_ns() - start > SPIN_NS)
            break;
    }
    /* Paired with the publisher's store of seq then load of waiters (all sequentially consistent): either it
     * sees waiters > 0 and wakes us, or we see its new seq here. */
    __atomic_fetch_add(&peer->waiters, 1, __ATOMIC_SEQ_CST);
    int rc = 0;
    int64_t checked = now_ns();
    for (;;) {
        const uint32_t seen = __atomic_load_n(&peer->seq, __ATOMIC_SEQ_CST);
        if (reached(seen, target))
            break;
        sleep_on(&peer->seq, seen);
        if (now_ns() - checked >= SLEEP_NS) {
            checked = now_ns();
            if (process_gone((pid_t)peer->pid)) {
                rc = -1;
                break;
            }
        }
    }
    __atomic_fetch_sub(&peer->waiters, 1, __ATOMIC_SEQ_CST);
    return rc;
}

/* out[i] += src[i]. Not inlined, so that no compiler can fuse two ranks' passes and reassociate the sum. */
__attribute__((noinline)) static void add_into(float *restrict out, const float *restrict src, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        out[i] += src[i];
}

int64_t shm_all_reduce_segment_bytes(int64_t ranks, int64_t slot_floats)
{
    return ranks * LINE_BYTES + ranks * 2 * slot_floats * (int64_t)sizeof(float);
}

/* Record this rank's pid in its control line (the peers check it while they wait). */
void shm_all_reduce_join(void *base, int64_t rank, int64_t pid)
{
    rank_line *line = (rank_line *)base + rank;
    __atomic_store_n(&line->pid, pid, __ATOMIC_SEQ_CST);
}

int64_t shm_all_reduce_pid(void *base, int64_t rank)
{
    return __atomic_load_n(&((rank_line *)base + rank)->pid, __ATOMIC_SEQ_CST);
}

/* x[0 .. n) = the sum over ranks of their x, in rank order, on every rank (all ranks call this with the same
 * n). Returns 0, or p + 1 when peer rank p died (the group cannot be used any more). */
int shm_all_reduce_f32(void *base, int64_t rank, int64_t ranks, int64_t slot_floats, float *x, int64_t n)
{
    rank_line *lines = (rank_line *)base;
    float *slots = (float *)((char *)base + ranks * LINE_BYTES);
    rank_line *me = &lines[rank];
    for (int64_t offset = 0; offset < n; offset += slot_floats) {
        const int64_t m = n - offset < slot_floats ? n - offset : slot_floats;
        const uint32_t seq = __atomic_load_n(&me->seq, __ATOMIC_RELAXED) + 1; /* only this rank writes it */
        const int64_t half = seq & 1;
        float *out = x + offset;
        memcpy(slots + (rank * 2 + half) * slot_floats, out, (size_t)m * sizeof(float));
        __atomic_store_n(&me->seq, seq, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&me->waiters, __ATOMIC_SEQ_CST) != 0)
            wake_all(&me->seq);
        for (int64_t p = 0; p < ranks; p++)
            if (p != rank && wait_for(&lines[p], seq) != 0)
                return (int)p + 1;
        for (int64_t b = 0; b < m; b += SUM_BLOCK_FLOATS) {
            const int64_t len = m - b < SUM_BLOCK_FLOATS ? m - b : SUM_BLOCK_FLOATS;
            memcpy(out + b, slots + half * slot_floats + b, (size_t)len * sizeof(float));
            for (int64_t p = 1; p < ranks; p++)
                add_into(out + b, slots + (p * 2 + half) * slot_floats + b, len);
        }
    }
    return 0;
}
