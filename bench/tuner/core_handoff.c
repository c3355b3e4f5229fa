/* Round trip of one cache line between CPU 0 and CPU 1, in ns: a thread on each, handing a flag back
 * and forth. Prints one mean per line read from stdin, each over `ms` milliseconds (argv[1]), so a
 * caller can probe before and after its own measurement without restarting the pair. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static _Atomic int flag __attribute__((aligned(64)));
static _Atomic int stop __attribute__((aligned(64)));

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}

static void *answer(void *unused) {
    (void)unused;
    pin(1);
    while (!atomic_load_explicit(&stop, memory_order_relaxed))
        if (atomic_load_explicit(&flag, memory_order_acquire) == 1)
            atomic_store_explicit(&flag, 0, memory_order_release);
    return NULL;
}

int main(int argc, char **argv) {
    double window = (argc > 1 ? atof(argv[1]) : 200.0) / 1e3;
    char line[64];
    pthread_t t;
    pin(0);
    while (fgets(line, sizeof line, stdin)) {
        atomic_store(&stop, 0);
        pthread_create(&t, NULL, answer, NULL); /* only while probing: it spins */
        double t0 = now();
        long n = 0;
        while (now() - t0 < window) {
            for (int i = 0; i < 1000; i++) {
                atomic_store_explicit(&flag, 1, memory_order_release);
                while (atomic_load_explicit(&flag, memory_order_acquire) == 1)
                    ;
            }
            n += 1000;
        }
        double ns = (now() - t0) / n * 1e9;
        atomic_store(&stop, 1);
        pthread_join(t, NULL);
        printf("%.1f\n", ns);
        fflush(stdout);
    }
    return 0;
}
