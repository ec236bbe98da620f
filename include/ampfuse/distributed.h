#pragma once
// Several processes, started as torchrun starts them: each reads its place
// from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
// LOCAL_RANK) and joins one c10d process group over a TCPStore that rank 0
// serves. Give the group to GradScalerOptions::process_group.
//
//   const auto env = ampfuse::distributed::launch_env();
//   auto group = ampfuse::distributed::init_process_group(env);   // Gloo; init_process_group(env, true): NCCL too
//   ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().process_group(group));
//
// docs/distributed.md says which ranks call what, and in which order.

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace ampfuse::distributed {

/// This process's place among the ranks, from torchrun's variables.
struct LaunchEnv {
  int rank = 0;                           ///< RANK
  int world_size = 1;                     ///< WORLD_SIZE
  int local_rank = 0;                     ///< LOCAL_RANK (RANK when unset): the CUDA device to use
  std::string master_addr = "127.0.0.1";  ///< MASTER_ADDR: where rank 0 serves the store
  std::uint16_t master_port = 29500;      ///< MASTER_PORT
};

/// Reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (required: torchrun
/// sets them all) and LOCAL_RANK (optional). Throws c10::Error naming a
/// variable that is missing or not a number in its range (RANK below
/// WORLD_SIZE, a port in 1..65535).
LaunchEnv launch_env();
/// The same, reading each variable through `lookup` (null: unset) instead
/// of the environment (a launcher's own configuration, or a test's).
LaunchEnv launch_env(const std::function<const char*(const char*)>& lookup);

/// Every rank calls it once, with the same `timeout`: a c10d::TCPStore
/// (served by rank 0 at MASTER_ADDR:MASTER_PORT) and a process group over it,
/// with Gloo for CPU tensors and, when `cuda` (a CUDA build; call
/// c10::cuda::set_device(env.local_rank) first), NCCL for CUDA tensors. The
/// rendezvous and every collective fail with an error after `timeout`
/// instead of waiting forever for a rank that does not come (and reaching
/// the store fails after `timeout` and 5 s where a program other than rank
/// 0's store listens on MASTER_PORT and never answers). SIGPIPE is
/// ignored from then on when it had its default action (as Python does),
/// so that a peer that went away is an error, not the end of this process.
c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const LaunchEnv& env, bool cuda = false,
                                                          std::chrono::milliseconds timeout = std::chrono::seconds(60));

}  // namespace ampfuse::distributed
