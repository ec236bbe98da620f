#pragma once
// Ranks as threads: a Gloo process group per thread over one c10d::HashStore.

#include <torch/csrc/distributed/c10d/HashStore.hpp>
// The wheel's LibTorch is built with Gloo; its header declares the class only with this set.
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tests/common.h"

namespace ampfuse_test {

// c10d's flight recorder (a process-wide trace of collectives, on by
// default) is not safe when several process groups in one process issue
// collectives at once, as ranks as threads do: under load its map insert
// crashed about once in 100 runs. Turned off here, before main() and before
// anything reads the variable (no thread exists yet); one process per rank
// (tests/dist_rank.cpp, and real runs) keeps it.
inline const bool kFlightRecorderOff = [] { return setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0) == 0; }();

// Runs fn(rank, group) on `world` threads, each with its own Gloo process
// group over one HashStore (loopback), with a bounded timeout on every
// collective (`timeout`; setting up the group may take 20 s). An exception on a rank is reported as a failure naming it.
inline void on_ranks(int world, const std::function<void(int, const c10::intrusive_ptr<c10d::ProcessGroup>&)>& fn,
                     std::chrono::milliseconds timeout = std::chrono::milliseconds(20000)) {
  EXPECT_TRUE(kFlightRecorderOff);
  // A rank whose peer closed its sockets must get an error, not SIGPIPE (Python ignores it too).
  std::signal(SIGPIPE, SIG_IGN);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> threads;
  std::mutex mutex;
  std::vector<std::string> errors;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto options = c10d::ProcessGroupGloo::Options::create();
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
        // The group connects within the default bound, however short the
        // collectives' one: a test of a timeout must not fail instead because
        // setting up took long on a loaded machine (two sanitizer shards on two cores).
        options->timeout = std::max(timeout, std::chrono::milliseconds(20000));
        // A ProcessGroup over a Gloo backend for CPU tensors, as torch.distributed makes it.
        auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, options);
        gloo->setTimeout(timeout);
        auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world);
        group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
        group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
        fn(rank, group);
      } catch (const std::exception& e) {
        const std::lock_guard<std::mutex> lock(mutex);
        errors.push_back("rank " + std::to_string(rank) + ": " + e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) ADD_FAILURE() << e;
}

}  // namespace ampfuse_test
