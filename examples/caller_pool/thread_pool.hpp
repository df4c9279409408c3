// A small fixed pool of threads that runs the parallel parts of convgrad kernels built
// with `convgrad aot --threading caller`: pass ThreadPool::parallel_for and the pool in
// convgrad_dims, and the pool's worker count as dims.num_threads.
//
// `workers` threads run the parts: the thread that calls parallel_for and workers - 1
// threads of the pool. Idle threads spin for about a millisecond before they sleep, so
// the regions of one kernel call, back to back, find them awake (as OpenMP's do).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CONVGRAD_POOL_PAUSE() _mm_pause()
#else
#define CONVGRAD_POOL_PAUSE() std::this_thread::yield()
#endif

#include "convgrad_kernels.h"

class ThreadPool {
public:
    explicit ThreadPool(unsigned workers)
    {
        for (unsigned i = 1; i < workers; ++i)
            threads_.emplace_back([this] { work(); });
    }

    ~ThreadPool()
    {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stop_ = true;
            generation_.fetch_add(1, std::memory_order_release);
        }
        wake_.notify_all();
        for (std::thread &thread : threads_)
            thread.join();
    }

    ThreadPool(const ThreadPool &) = delete;
    ThreadPool &operator=(const ThreadPool &) = delete;

    unsigned workers() const { return static_cast<unsigned>(threads_.size()) + 1; }

    // A convgrad_parallel_for: runs task(argument, i) once for every i < count, on the
    // calling thread and the pool's, and returns when all have run.
    static void parallel_for(void *pool, convgrad_task task, void *argument, size_t count)
    {
        static_cast<ThreadPool *>(pool)->run(task, argument, count);
    }

private:
    struct Job {
        convgrad_task task;
        void *argument;
        size_t count;
        std::atomic<size_t> next{0}, done{0};
        int takers = 0;  // pool threads working on it (under mutex_)
    };

    static constexpr int kSpins = 20000;  // pauses before a thread sleeps

    void run(convgrad_task task, void *argument, size_t count)
    {
        if (threads_.empty() || count <= 1) {
            for (size_t i = 0; i < count; ++i)
                task(argument, i);
            return;
        }
        Job job{task, argument, count};
        {
            std::lock_guard<std::mutex> lock(mutex_);
            current_ = &job;
            generation_.fetch_add(1, std::memory_order_release);
        }
        wake_.notify_all();
        take_parts(job);
        while (job.done.load(std::memory_order_acquire) < count)
            CONVGRAD_POOL_PAUSE();
        // No pool thread may still hold the job (on this stack) once this returns.
        std::unique_lock<std::mutex> lock(mutex_);
        current_ = nullptr;
        idle_.wait(lock, [&] { return job.takers == 0; });
    }

    static void take_parts(Job &job)
    {
        for (size_t i; (i = job.next.fetch_add(1, std::memory_order_relaxed)) < job.count;) {
            job.task(job.argument, i);
            job.done.fetch_add(1, std::memory_order_release);
        }
    }

    void work()
    {
        uint64_t seen = 0;
        for (;;) {
            for (int spin = 0; spin < kSpins
                               && generation_.load(std::memory_order_acquire) == seen; ++spin)
                CONVGRAD_POOL_PAUSE();
            Job *job;
            {
                std::unique_lock<std::mutex> lock(mutex_);
                wake_.wait(lock, [&] {
                    return generation_.load(std::memory_order_acquire) != seen;
                });
                if (stop_)
                    return;
                seen = generation_.load(std::memory_order_acquire);
                job = current_;
                if (!job)
                    continue;
                ++job->takers;
            }
            take_parts(*job);
            std::lock_guard<std::mutex> lock(mutex_);
            if (--job->takers == 0)
                idle_.notify_all();
        }
    }

    std::vector<std::thread> threads_;
    std::mutex mutex_;
    std::condition_variable wake_, idle_;
    std::atomic<uint64_t> generation_{0};
    Job *current_ = nullptr;
    bool stop_ = false;
};
