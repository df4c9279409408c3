/*
 * Calls two convgrad kernels built ahead of time, with no Python involved:
 *
 *   convgrad aot examples/c_api/layers.json -o build/aot
 *   make -C examples/c_api AOT=../../build/aot
 *
 * Layer "example_data": ConvolutionBackwardData, diff_dst (1, 6, 5, 8) NXC, weights XIO
 * (3, 3, 4, 8), strides 2, pads 1 -> diff_src (1, 11, 9, 4).
 * Layer "example_weights": ConvolutionBackwardWeights of the same convolution, src
 * (1, 11, 9, 4) and diff_dst (1, 6, 5, 8) -> diff_weights XIO (3, 3, 4, 8).
 * The inputs are small integers from a fixed pattern; the program prints every result
 * value, one per line, so a test can compare them with the reference.
 */
#include <stdio.h>
#include <stdlib.h>

#include "convgrad_kernels.h"

enum { N = 1, XH = 6, XW = 5, OC = 8, IC = 4, KH = 3, KW = 3, YH = 11, YW = 9 };

static void fill(float *values, int count, int multiplier)
{
    for (int i = 0; i < count; ++i)
        values[i] = (float)((i * multiplier) % 5 - 2);
}

static int print_all(const char *label, const float *values, int count)
{
    printf("%s\n", label);
    for (int i = 0; i < count; ++i)
        printf("%.1f\n", values[i]);
    return 0;
}

int main(void)
{
    static float diff_dst[N * XH * XW * OC], weights[KH * KW * IC * OC];
    static float src[N * YH * YW * IC];
    /* results on 64-byte boundaries are fastest (no vector straddles cache lines) */
    static _Alignas(64) float diff_src[N * YH * YW * IC];
    static _Alignas(64) float diff_weights[KH * KW * IC * OC];
    fill(diff_dst, N * XH * XW * OC, 7);
    fill(weights, KH * KW * IC * OC, 3);
    fill(src, N * YH * YW * IC, 11);

    /* sizes of the forward convolution: src (the large tensor), dst (diff_dst), pads */
    const convgrad_dims dims = {.batch = N, .src = {YH, YW}, .dst = {XH, XW},
                                .pads_begin = {1, 1}, .num_threads = 1,
                                .size = sizeof(convgrad_dims)};

    /* With a workspace the caller keeps ... */
    void *workspace = malloc((size_t)convgrad_example_data_workspace_size(&dims));
    if (!workspace || convgrad_example_data(diff_dst, weights, diff_src, &dims, workspace)) {
        fprintf(stderr, "example_data failed\n");
        return 1;
    }
    free(workspace);
    /* ... or without: the kernel then allocates one for the call. */
    if (convgrad_example_weights(src, diff_dst, diff_weights, &dims, NULL)) {
        fprintf(stderr, "example_weights failed\n");
        return 1;
    }
    print_all("diff_src", diff_src, N * YH * YW * IC);
    print_all("diff_weights", diff_weights, KH * KW * IC * OC);
    return 0;
}
