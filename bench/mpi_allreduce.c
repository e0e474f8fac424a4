/*
 * mpi_allreduce: the MPI side of bench/allreduce_vs_mpi.sh. Not built with
 * the tree (MPI is an optional benchmark dependency): the script compiles
 * it with mpicc and runs it under mpirun over the TCP transport.
 *
 *   mpirun -np N mpi_allreduce --mb M|--kb K [--runs R]
 *
 * Every rank fills M MiB of float32 with the same values as
 * bench_allreduce's peers (value(rank, k) = base(k) + rank / 4), then runs
 * one warm-up round and R measured rounds of MPI_Allreduce(MPI_IN_PLACE,
 * MPI_SUM) followed by a division by N, so that both programs compute the
 * average. Rounds are separated by MPI_Barrier; a round's time is the
 * slowest rank's, as for bench_allreduce. Each round's result is checked
 * (outside the timing) and the vector refilled. Prints the per-round times,
 * the median and the peak resident memory (VmHWM) of the largest rank, and
 * a "RESULT ..." line for scripts. Exit status 0 when every result was
 * right.
 */
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static long proc_status_kb(const char *field)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kb = 0;
    size_t fl = strlen(field);
    if (f == NULL)
        return 0;
    while (fgets(line, sizeof(line), f) != NULL)
        if (strncmp(line, field, fl) == 0) {
            kb = strtol(line + fl, NULL, 10);
            break;
        }
    fclose(f);
    return kb;
}

/* The same pattern as bench_allreduce: multiples of 1/512 in [-1, 1). */
static inline float base_value(size_t k)
{
    uint32_t h = (uint32_t)k * 2654435761u;
    return (float)((h >> 16) & 1023u) / 512.0f - 1.0f;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    int rank, size, kb = 0, runs = 5;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--mb") == 0 && i + 1 < argc && atoi(argv[i + 1]) <= 1024)
            kb = atoi(argv[++i]) * 1024;
        else if (strcmp(argv[i], "--kb") == 0 && i + 1 < argc)
            kb = atoi(argv[++i]);
        else if (strcmp(argv[i], "--runs") == 0 && i + 1 < argc)
            runs = atoi(argv[++i]);
    }
    if (kb < 1 || kb > 1024 * 1024 || runs < 1 || runs > 1000) {
        if (rank == 0)
            fprintf(stderr, "usage: mpirun -np N mpi_allreduce --mb M|--kb K [--runs R]\n");
        MPI_Finalize();
        return 64;
    }
    long base_kb = proc_status_kb("VmRSS:");
    size_t n = (size_t)kb * (1024u / sizeof(float));
    double mb = (double)kb / 1024.0;
    float *data = malloc(n * sizeof(float));
    double *times = calloc((size_t)runs + 1, sizeof(double));
    if (data == NULL || times == NULL)
        MPI_Abort(MPI_COMM_WORLD, 1);
    float add = 0.25f * (float)rank;
    double mean_add = 0.125 * (double)(size - 1);
    double tol = 1e-6 * (1.0 + 0.25 * (double)(size - 1));
    float inv = 1.0f / (float)size;
    long bad = 0;
    for (size_t k = 0; k < n; k++)
        data[k] = base_value(k) + add;

    for (int r = 0; r <= runs; r++) {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        MPI_Allreduce(MPI_IN_PLACE, data, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        for (size_t k = 0; k < n; k++)
            data[k] *= inv;
        double el = MPI_Wtime() - t0, slowest = 0;
        MPI_Reduce(&el, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        times[r] = slowest;
        for (size_t k = 0; k < n; k++) {
            double e = (double)base_value(k) + mean_add;
            if (!(fabs((double)data[k] - e) <= tol))
                bad++;
            data[k] = base_value(k) + add;
        }
    }

    long hwm = proc_status_kb("VmHWM:"), extra = hwm - base_kb, peak_max = 0, extra_max = 0,
         bad_all = 0;
    MPI_Reduce(&hwm, &peak_max, 1, MPI_LONG, MPI_MAX, 0, MPI_COMM_WORLD);
    MPI_Reduce(&extra, &extra_max, 1, MPI_LONG, MPI_MAX, 0, MPI_COMM_WORLD);
    MPI_Reduce(&bad, &bad_all, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        printf("mpi_allreduce: %d ranks, %g MiB of float32 each, MPI_Allreduce SUM then / N; "
               "%d rounds after a warm-up round\n",
               size, mb, runs);
        for (int r = 0; r <= runs; r++)
            printf("%-8s %10.4f\n", r == 0 ? "warm-up" : "", times[r]);
        double warm = times[0];
        qsort(times + 1, (size_t)runs, sizeof(double), cmp_double);
        double med = runs % 2 ? times[1 + runs / 2] : (times[runs / 2] + times[runs / 2 + 1]) / 2;
        double pm = (double)peak_max / 1024.0, em = (double)extra_max / 1024.0;
        printf("median of the slowest rank: %.4f s (max %.4f s); peak RSS per rank %.1f MiB = "
               "%.2fx the tensor (%.2fx above what it held before); %ld elements off\n",
               med, times[runs], pm, pm / mb, em / mb, bad_all);
        printf("RESULT peers=%d mb=%g median_s=%.6f max_s=%.6f warmup_s=%.6f peak_mib=%.1f "
               "peak_ratio=%.3f extra_ratio=%.3f ok=%d\n",
               size, mb, med, times[runs], warm, pm, pm / mb, em / mb, bad_all == 0);
    }
    free(data);
    free(times);
    MPI_Finalize();
    return bad_all == 0 || rank != 0 ? 0 : 1;
}
