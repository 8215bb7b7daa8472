/* The machine's cross-core cache-line round trip: what a node synchronisation waits for, and the
 * clearest sign of this VM's speed phase (benchmarks/README.md, issue 23's twelfth session).
 *
 *   cc -O2 -pthread benchmarks/core_round_trip.c -o /tmp/core_round_trip && /tmp/core_round_trip [A B]
 *
 * Two threads pinned to cores A and B (default 0 and 1) pass one cache line back and forth through an
 * atomic counter; prints the median over up to 9 rounds of 20,000 round trips, in nanoseconds. A busy
 * machine, on which a trip may wait for a time slice, ends it after about 2 seconds, with the rounds
 * (or the part of one) done by then. Exit status 2, with the reason on stderr, where a core cannot be
 * used. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TRIPS 20000
#define ROUNDS 9
#define CHECK_EVERY 1000 /* trips between looks at the clock */
#define MAX_SECONDS 2.0
#define STOP (-1L) /* the last value main writes: the answering thread returns */

static _Alignas(64) _Atomic long line;

static void *answer(void *unused) {
    (void)unused;
    for (long want = 1;; want += 2) {
        long seen;
        while ((seen = atomic_load_explicit(&line, memory_order_acquire)) != want)
            if (seen == STOP)
                return NULL;
        atomic_store_explicit(&line, want + 1, memory_order_release);
    }
}

static int core_arg(const char *text, int *core) {
    char *end;
    errno = 0;
    long value = strtol(text, &end, 10);
    if (errno || *end || end == text || value < 0 || value >= CPU_SETSIZE)
        return -1;
    *core = (int)value;
    return 0;
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int a = 0, b = 1;
    if (argc != 1 && (argc != 3 || core_arg(argv[1], &a) || core_arg(argv[2], &b))) {
        fprintf(stderr, "usage: core_round_trip [CORE_A CORE_B] (two core numbers)\n");
        return 2;
    }
    if (a == b) { /* both spinning threads on one core would wait for time slices, not the line */
        fprintf(stderr, "core_round_trip: give two different cores, got %d twice\n", a);
        return 2;
    }
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(a, &set);
    int err = pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    if (err) {
        fprintf(stderr, "core_round_trip: cannot run on core %d: %s\n", a, strerror(err));
        return 2;
    }
    pthread_attr_t attr; /* the answering thread starts on its core: it never waits for main's */
    pthread_attr_init(&attr);
    CPU_ZERO(&set);
    CPU_SET(b, &set);
    pthread_attr_setaffinity_np(&attr, sizeof set, &set);
    pthread_t other;
    err = pthread_create(&other, &attr, answer, NULL);
    pthread_attr_destroy(&attr);
    if (err) {
        fprintf(stderr, "core_round_trip: cannot run on core %d: %s\n", b, strerror(err));
        return 2;
    }
    double ns[ROUNDS], start = seconds();
    int rounds = 0;
    long sent = 1; /* the next odd value main writes */
    while (rounds < ROUNDS) {
        double t0 = seconds();
        long trips = 0;
        int late = 0;
        while (trips < TRIPS && !late) {
            atomic_store_explicit(&line, sent, memory_order_release);
            while (atomic_load_explicit(&line, memory_order_acquire) != sent + 1)
                ;
            sent += 2;
            if (++trips % CHECK_EVERY == 0)
                late = seconds() - start > MAX_SECONDS;
        }
        ns[rounds++] = (seconds() - t0) * 1e9 / (double)trips;
        if (late)
            break;
    }
    atomic_store_explicit(&line, STOP, memory_order_release);
    pthread_join(other, NULL);
    qsort(ns, (size_t)rounds, sizeof ns[0], by_value);
    printf("%.0f\n", ns[rounds / 2]);
    return 0;
}
