#pragma once
// Lets gloo's rendezvous (gloo::rendezvous::Context::connectFullMesh) run over a comm::Store.
// Every key is put under a prefix unique to one communicator, so several communicators can
// rendezvous over the same store. With `names`, it also learns which rank listens at which
// address from the addresses gloo's full-mesh rendezvous publishes (key "<rank>": one tcp address
// per pair, each pair with its own listener), so that errors can name ranks instead of addresses
// (PeerNames::learn_accepted() adds the peers that connected to our listeners).

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/address.h>

#include <comm/detail/gloo/errors.hpp>
#include <comm/store.hpp>

namespace comm::detail::gloo {

class StoreAdapter final : public ::gloo::rendezvous::Store {
 public:
  StoreAdapter(std::shared_ptr<comm::Store> store, std::string prefix, std::chrono::milliseconds timeout,
               PeerNames* names = nullptr)
      : store_(std::move(store)), prefix_(std::move(prefix)), timeout_(timeout), names_(names) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    if (names_ != nullptr) learn(key, data, true);
    store_->set(prefix_ + key,
                std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(data.data()), data.size()));
  }

  std::vector<char> get(const std::string& key) override {
    // comm::Store::get blocks with the store's own timeout; wait first so the communicator's
    // timeout (which may be shorter) bounds rendezvous.
    const std::string k = prefix_ + key;
    store_->wait({k}, timeout_);
    const auto bytes = store_->get(k);
    std::vector<char> value(bytes.begin(), bytes.end());
    if (names_ != nullptr) learn(key, value, false);
    return value;
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const auto& k : keys) full.push_back(prefix_ + k);
    store_->wait(full, timeout.count() > 0 ? timeout : timeout_);
  }

 private:
  // Rank r's value under key "r" is its pairs' addresses, fixed-size tcp::Address records; all
  // name r's listening socket ("[ip]:port$seq"), so each maps "[ip]:port" to r.
  // Our own value (`mine`): our listening address for each peer, in rank order without us.
  void learn(const std::string& key, const std::vector<char>& value, bool mine) const {
    if (key.empty() || key.size() > 9 || key.find_first_not_of("0123456789") != std::string::npos) return;
    const int r = std::stoi(key);
    const std::size_t record = ::gloo::transport::tcp::Address().bytes().size();
    if (record == 0 || value.empty() || value.size() % record != 0) return;
    for (std::size_t at = 0; at < value.size(); at += record) {
      try {
        const std::vector<char> one(value.begin() + static_cast<std::ptrdiff_t>(at),
                                    value.begin() + static_cast<std::ptrdiff_t>(at + record));
        std::string a = ::gloo::transport::tcp::Address(one).str();
        if (const auto seq = a.rfind('$'); seq != std::string::npos) a.resize(seq);
        if (a.empty()) continue;
        if (!mine) {
          names_->learn(std::move(a), r);
        } else {
          const int peer = static_cast<int>(at / record);
          names_->listening(std::move(a), peer < r ? peer : peer + 1);
        }
      } catch (...) {
        return;  // not what this gloo publishes: errors keep the addresses
      }
    }
  }

  std::shared_ptr<comm::Store> store_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
  PeerNames* names_;
};

}  // namespace comm::detail::gloo
