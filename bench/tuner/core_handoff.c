/* Round trip of one cache line between CPU 0 and CPU 1, in ns. For each line read from stdin, a
 * thread is started on CPU 1 (only while probing: it spins), the two hand a flag back and forth for
 * argv[1] milliseconds, and the mean round trip is printed. */
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

static cpu_set_t one_cpu(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    return s;
}

static void *answer(void *unused) {
    (void)unused;
    atomic_store_explicit(&flag, 0, memory_order_release); /* here, on CPU 1: ready */
    while (!atomic_load_explicit(&stop, memory_order_relaxed))
        if (atomic_load_explicit(&flag, memory_order_acquire) == 1)
            atomic_store_explicit(&flag, 0, memory_order_release);
    return NULL;
}

int main(int argc, char **argv) {
    double window = (argc > 1 ? atof(argv[1]) : 200.0) / 1e3;
    cpu_set_t cpu0 = one_cpu(0), cpu1 = one_cpu(1);
    pthread_attr_t attr;
    char line[64];
    if (pthread_setaffinity_np(pthread_self(), sizeof cpu0, &cpu0) != 0 || pthread_attr_init(&attr) != 0 ||
        pthread_attr_setaffinity_np(&attr, sizeof cpu1, &cpu1) != 0) {
        fprintf(stderr, "core_handoff: cannot pin threads to CPU 0 and CPU 1\n");
        return 1;
    }
    while (fgets(line, sizeof line, stdin)) {
        pthread_t t;
        atomic_store(&stop, 0);
        atomic_store(&flag, 1);
        if (pthread_create(&t, &attr, answer, NULL) != 0) {
            fprintf(stderr, "core_handoff: cannot start the thread on CPU 1\n");
            return 1;
        }
        while (atomic_load_explicit(&flag, memory_order_acquire) == 1) /* it has started */
            ;
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
