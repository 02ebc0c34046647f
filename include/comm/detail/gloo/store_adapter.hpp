#pragma once
// Lets gloo's rendezvous (gloo::rendezvous::Context::connectFullMesh) run over a comm::Store.
// Every key is put under a prefix unique to one communicator, so several communicators can
// rendezvous over the same store.

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <gloo/rendezvous/store.h>

#include <comm/store.hpp>

namespace comm::detail::gloo {

class StoreAdapter final : public ::gloo::rendezvous::Store {
 public:
  StoreAdapter(std::shared_ptr<comm::Store> store, std::string prefix, std::chrono::milliseconds timeout)
      : store_(std::move(store)), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(prefix_ + key,
                std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(data.data()), data.size()));
  }

  std::vector<char> get(const std::string& key) override {
    // comm::Store::get blocks with the store's own timeout; wait first so the communicator's
    // timeout (which may be shorter) bounds rendezvous.
    const std::string k = prefix_ + key;
    store_->wait({k}, timeout_);
    const auto bytes = store_->get(k);
    return std::vector<char>(bytes.begin(), bytes.end());
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const auto& k : keys) full.push_back(prefix_ + k);
    store_->wait(full, timeout.count() > 0 ? timeout : timeout_);
  }

 private:
  std::shared_ptr<comm::Store> store_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

}  // namespace comm::detail::gloo
