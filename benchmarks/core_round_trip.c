/* The machine's cross-core cache-line round trip: what a node synchronisation waits for, and the
 * clearest sign of this VM's speed phase (benchmarks/README.md, "The VM's phases").
 *
 *   cc -O2 -pthread benchmarks/core_round_trip.c -o /tmp/core_round_trip && /tmp/core_round_trip [A B]
 *
 * Two threads pinned to cores A and B (default 0 and 1) pass one cache line back and forth through an
 * atomic counter; prints the median over 9 rounds of 20,000 round trips, in nanoseconds. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define TRIPS 20000
#define ROUNDS 9

static _Alignas(64) _Atomic long line;
static _Atomic int ready; /* 1: the answering thread runs on its core; -1: it could not */
static int core_b;

static int pin(int core) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(core, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *answer(void *unused) {
    (void)unused;
    if (pin(core_b)) {
        atomic_store(&ready, -1);
        return NULL;
    }
    atomic_store(&ready, 1);
    for (long i = 0; i < (long)TRIPS * ROUNDS; i++) {
        while (atomic_load_explicit(&line, memory_order_acquire) != 2 * i + 1)
            ;
        atomic_store_explicit(&line, 2 * i + 2, memory_order_release);
    }
    return NULL;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int core_a = argc > 2 ? atoi(argv[1]) : 0;
    core_b = argc > 2 ? atoi(argv[2]) : 1;
    if (core_a == core_b) { /* both spinning threads on one core would wait for time slices, not the line */
        fprintf(stderr, "core_round_trip: give two different cores, got %d twice\n", core_a);
        return 2;
    }
    if (pin(core_a)) {
        fprintf(stderr, "core_round_trip: cannot run on core %d\n", core_a);
        return 2;
    }
    pthread_t other;
    if (pthread_create(&other, NULL, answer, NULL))
        return 2;
    while (atomic_load(&ready) == 0)
        ;
    if (atomic_load(&ready) < 0) {
        pthread_join(other, NULL);
        fprintf(stderr, "core_round_trip: cannot run on core %d\n", core_b);
        return 2;
    }
    double ns[ROUNDS];
    long i = 0;
    for (int r = 0; r < ROUNDS; r++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (long end = i + TRIPS; i < end; i++) {
            atomic_store_explicit(&line, 2 * i + 1, memory_order_release);
            while (atomic_load_explicit(&line, memory_order_acquire) != 2 * i + 2)
                ;
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        ns[r] = ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / TRIPS;
    }
    pthread_join(other, NULL);
    qsort(ns, ROUNDS, sizeof ns[0], by_value);
    printf("%.0f\n", ns[ROUNDS / 2]);
    return 0;
}
