// Runs two convgrad kernels built with `convgrad aot --threading caller` on the
// program's own thread pool (thread_pool.hpp), with no OpenMP in the process:
//
//   convgrad aot examples/c_api/layers.json --threading caller -o build/aot-caller
//   make -C examples/caller_pool AOT=../../build/aot-caller
//   ./examples/caller_pool/convgrad_pool_example 2
//
// The layers are examples/c_api's (see its main.c); the argument is the pool's worker
// count (default 2). The program prints every result value, one per line; the results
// are the same for every worker count.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "thread_pool.hpp"

enum { N = 1, XH = 6, XW = 5, OC = 8, IC = 4, KH = 3, KW = 3, YH = 11, YW = 9 };

static std::vector<float> pattern(int count, int multiplier)
{
    std::vector<float> values(count);
    for (int i = 0; i < count; ++i)
        values[i] = static_cast<float>((i * multiplier) % 5 - 2);
    return values;
}

static void print_all(const char *label, const std::vector<float> &values)
{
    std::printf("%s\n", label);
    for (float value : values)
        std::printf("%.1f\n", value);
}

int main(int argc, char **argv)
{
    const int workers = argc > 1 ? std::atoi(argv[1]) : 2;
    if (workers < 1 || convgrad_check_abi(CONVGRAD_ABI_VERSION) != CONVGRAD_OK) {
        std::fprintf(stderr, "usage: %s [workers >= 1] (and a library of this header's ABI)\n",
                     argv[0]);
        return 2;
    }
    ThreadPool pool(static_cast<unsigned>(workers));
    const std::vector<float> diff_dst = pattern(N * XH * XW * OC, 7);
    const std::vector<float> weights = pattern(KH * KW * IC * OC, 3);
    const std::vector<float> src = pattern(N * YH * YW * IC, 11);
    std::vector<float> diff_src(N * YH * YW * IC), diff_weights(KH * KW * IC * OC);

    convgrad_dims dims = CONVGRAD_DIMS_INIT;
    dims.batch = N;
    dims.src[0] = YH, dims.src[1] = YW;
    dims.dst[0] = XH, dims.dst[1] = XW;
    dims.pads_begin[0] = 1, dims.pads_begin[1] = 1;
    dims.num_threads = static_cast<int32_t>(pool.workers());  // parts sized for the pool
    dims.parallel_for = ThreadPool::parallel_for;
    dims.pool = &pool;

    // The workspace depends on num_threads (scratch per part); kept between calls.
    std::vector<char> workspace(convgrad_example_data_workspace_size(&dims));
    if (convgrad_example_data(diff_dst.data(), weights.data(), diff_src.data(), &dims,
                              workspace.data())
        || convgrad_example_weights(src.data(), diff_dst.data(), diff_weights.data(), &dims,
                                    nullptr)) {
        std::fprintf(stderr, "a kernel failed\n");
        return 1;
    }
    print_all("diff_src", diff_src);
    print_all("diff_weights", diff_weights);
    return 0;
}
