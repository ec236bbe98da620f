// torchrun's environment and a process group from it (ampfuse/distributed.h).

#include "ampfuse/distributed.h"

#include <c10/util/Exception.h>
#include <signal.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

// Gloo's and NCCL's c10d backends are declared only with these set, and need
// Gloo's headers (Debian's libgloo-dev; the wheel has Gloo's code, not its
// headers) and nccl.h (the wheel's nvidia/nccl package): CMake adds their
// folders when it finds them.
#if __has_include(<gloo/config.h>)
#define AMPFUSE_HAS_GLOO 1
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if defined(AMPFUSE_WITH_CUDA) && __has_include(<nccl.h>)
#define AMPFUSE_HAS_NCCL 1
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace ampfuse::distributed {
namespace {

constexpr const char* kWhere = "ampfuse::distributed::launch_env: ";

std::string required(const std::function<const char*(const char*)>& lookup, const char* name) {
  const char* value = lookup(name);
  TORCH_CHECK(value != nullptr && *value != '\0', kWhere, name,
              " is not set (start the processes with torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR and "
              "MASTER_PORT for each)");
  return value;
}

long number(const char* name, const std::string& text, long lowest, long highest) {
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(text.c_str(), &end, 10);
  TORCH_CHECK(errno == 0 && end != text.c_str() && *end == '\0' && value >= lowest && value <= highest, kWhere, name,
              "=", text, " is not a whole number from ", lowest, " to ", highest);
  return value;
}

}  // namespace

LaunchEnv launch_env() {
  return launch_env([](const char* name) -> const char* { return std::getenv(name); });
}

LaunchEnv launch_env(const std::function<const char*(const char*)>& lookup) {
  LaunchEnv env;
  env.world_size = static_cast<int>(number("WORLD_SIZE", required(lookup, "WORLD_SIZE"), 1, 1 << 20));
  env.rank = static_cast<int>(number("RANK", required(lookup, "RANK"), 0, env.world_size - 1));
  env.master_addr = required(lookup, "MASTER_ADDR");
  env.master_port = static_cast<std::uint16_t>(number("MASTER_PORT", required(lookup, "MASTER_PORT"), 1, 65535));
  const char* local = lookup("LOCAL_RANK");
  env.local_rank = local != nullptr && *local != '\0' ? static_cast<int>(number("LOCAL_RANK", local, 0, 1 << 20))
                                                      : env.rank;
  return env;
}

namespace {

// Before the backends, whose rendezvous waits without a timeout for a peer
// that never comes (a rank given another WORLD_SIZE, a RANK given twice by
// two runs on one port): every rank claims its rank once and compares its
// world size with rank 0's, and all wait, up to `timeout`, until every rank
// has passed or one has failed, whose error every rank then gives.
void check_rendezvous(c10d::Store& store, const LaunchEnv& env, std::chrono::milliseconds timeout) {
  const std::string where = c10::str("ampfuse::distributed::init_process_group (", env.master_addr, ":",
                                     env.master_port, ", RANK=", env.rank, ", WORLD_SIZE=", env.world_size, "): ");
  std::string failed;
  const std::int64_t claims = store.add("ampfuse/rank/" + std::to_string(env.rank), 1);
  if (claims != 1)
    failed = c10::str("rank ", env.rank, " joined the rendezvous ", claims,
                      " times: another run on this MASTER_PORT, or a process left from one");
  if (env.rank == 0 && failed.empty()) store.set("ampfuse/world_size", std::to_string(env.world_size));
  if (failed.empty()) {
    const std::vector<std::uint8_t> bytes = store.get("ampfuse/world_size");  // waits for rank 0 (timeout)
    const std::string theirs(bytes.begin(), bytes.end());
    if (theirs != std::to_string(env.world_size))
      failed = c10::str("rank ", env.rank, " was started with WORLD_SIZE=", env.world_size, ", rank 0 with ", theirs,
                        ": every rank must be given the same WORLD_SIZE");
  }
  if (!failed.empty()) {
    store.set("ampfuse/failed", where + failed);
    TORCH_CHECK(false, where, failed);
  }
  store.add("ampfuse/ready", 1);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (store.check({"ampfuse/failed"})) {
      const std::vector<std::uint8_t> bytes = store.get("ampfuse/failed");
      TORCH_CHECK(false, where, "another rank failed to join: ", std::string(bytes.begin(), bytes.end()));
    }
    if (store.add("ampfuse/ready", 0) >= env.world_size) return;
    TORCH_CHECK(std::chrono::steady_clock::now() < deadline, where, "only ", store.add("ampfuse/ready", 0), " of ",
                env.world_size, " ranks joined within the timeout of ", timeout.count(), " ms");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// The store, made on a thread of its own and given up on after the
// store's own timeout (which bounds its connecting) and a margin: a client
// that reaches a listener which is not a TCPStore (another program on
// MASTER_PORT) that accepts and never answers would otherwise wait for
// the answer to its first message forever. The thread, blocked in that read,
// is left behind (the process is expected to end on the error); where the
// store comes after all, the thread lets it go.
c10::intrusive_ptr<c10d::TCPStore> connect_store(const LaunchEnv& env, const c10d::TCPStoreOptions& options,
                                                 std::chrono::milliseconds timeout) {
  auto made = std::make_shared<std::promise<c10::intrusive_ptr<c10d::TCPStore>>>();
  std::future<c10::intrusive_ptr<c10d::TCPStore>> store = made->get_future();
  std::thread([made, addr = env.master_addr, options] {
    try {
      made->set_value(c10::make_intrusive<c10d::TCPStore>(addr, options));
    } catch (...) {
      made->set_exception(std::current_exception());
    }
  }).detach();
  // (A timeout of a year or more waits as long as the store does: the sum
  // could overflow, and so could the deadline wait_for takes from it.)
  if (timeout >= std::chrono::hours(24 * 365)) return store.get();
  const auto limit = timeout + std::chrono::seconds(5);
  TORCH_CHECK(store.wait_for(limit) == std::future_status::ready,
              "ampfuse::distributed::init_process_group (", env.master_addr, ":", env.master_port,
              ", RANK=", env.rank, ", WORLD_SIZE=", env.world_size, "): the store at ", env.master_addr, ":",
              env.master_port, " did not answer within ", limit.count(),
              " ms (the timeout and 5 s): something other than rank 0's store listens on MASTER_PORT?");
  return store.get();
}

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const LaunchEnv& env, bool cuda,
                                                          std::chrono::milliseconds timeout) {
  TORCH_CHECK(env.world_size >= 1 && env.rank >= 0 && env.rank < env.world_size,
              "ampfuse::distributed::init_process_group: rank ", env.rank, " is not below the world size ",
              env.world_size);
  // A peer that goes away must be an error on the sockets, not SIGPIPE, which
  // would end this process without a word (Python ignores it; so does this).
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) std::signal(SIGPIPE, SIG_IGN);
  c10d::TCPStoreOptions store_options;
  store_options.port = env.master_port;
  store_options.isServer = env.rank == 0;
  store_options.numWorkers = static_cast<std::size_t>(env.world_size);
  store_options.timeout = timeout;
  auto store = connect_store(env, store_options, timeout);
  check_rendezvous(*store, env, timeout);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, env.rank, env.world_size);
#if defined(AMPFUSE_HAS_GLOO)
  auto gloo_options = c10d::ProcessGroupGloo::Options::create();
  gloo_options->timeout = timeout;
  // On one machine, loopback; across machines, the interface this host's name resolves to.
  const bool loopback = env.master_addr == "127.0.0.1" || env.master_addr == "localhost";
  gloo_options->devices.push_back(loopback ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                           : c10d::ProcessGroupGloo::createDefaultDevice());
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>("gloo/", store),
                                                          env.rank, env.world_size, gloo_options);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
#else
  TORCH_CHECK(false, "ampfuse::distributed::init_process_group: ampfuse was built without Gloo's headers "
                     "(install libgloo-dev and rebuild)");
#endif
  if (cuda) {
#if defined(AMPFUSE_HAS_NCCL)
    auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
    nccl_options->timeout = timeout;
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(c10::make_intrusive<c10d::PrefixStore>("nccl/", store),
                                                            env.rank, env.world_size, nccl_options);
    group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
#else
    TORCH_CHECK(false, "ampfuse::distributed::init_process_group: NCCL was asked for, but ampfuse was built without "
                       "CUDA or without nccl.h (the wheel's nvidia/nccl package)");
#endif
  }
  return group;
}

}  // namespace ampfuse::distributed
