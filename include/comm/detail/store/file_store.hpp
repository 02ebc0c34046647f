#pragma once
// FileStore: definitions (declared in <comm/store.hpp>).
// Included by <comm/store.hpp> after the declarations, and only from there: the public header
// declares, detail/ defines, and nothing here includes back up (include <comm/store.hpp>).
//
// The file is a header "COMMFS1\n" followed by an append-only log of records
//   u8 type ('S' set, 'D' delete) | u32 key_len | u64 value_len | key | value
// Writers append under an exclusive lock, readers replay under a shared one; each instance keeps
// the map it replayed and the offset it reached. Locks are open-file-description locks
// (F_OFD_SETLK): they exclude other instances in the same process too, and vanish with a
// process that dies. A record cut short by a writer that died is cut off by the next writer.

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include <comm/detail/net/socket.hpp>
#include <comm/detail/store/common.hpp>
#include <comm/detail/store/protocol.hpp>

namespace comm {

namespace detail::file_store {
inline constexpr char header[] = "COMMFS1\n";
inline constexpr std::size_t header_size = 8;
inline constexpr std::size_t record_header_size = 13;

/// Sleeps for `step` or until `deadline`, whichever is first; returns the next step (doubling up
/// to `cap`).
inline std::chrono::microseconds backoff(std::chrono::microseconds step, Clock::time_point deadline,
                                         std::chrono::microseconds cap) {
  const auto now = Clock::now();
  if (deadline > now) std::this_thread::sleep_for(std::min<Clock::duration>(step, deadline - now));
  return std::min(step * 2, cap);
}
}  // namespace detail::file_store

/// Holds the file lock of a FileStore for one operation.
class FileStore::Lock {
 public:
  Lock(FileStore& s, bool exclusive, std::string_view op, detail::Clock::time_point deadline,
       std::chrono::milliseconds timeout)
      : fd_(s.fd_.get()) {
    auto step = std::chrono::microseconds(50);
    for (;;) {
      if (try_lock(exclusive)) return;
      if (errno != EAGAIN && errno != EACCES && errno != EINTR && errno != EWOULDBLOCK)
        throw BackendError(std::string(op), s.rank(), "cannot lock '" + s.path_ + "': " + detail::errno_text(errno));
      if (detail::Clock::now() >= deadline)
        throw Timeout(std::string(op), s.rank(),
                      "could not lock '" + s.path_ + "' within " + detail::format_ms(timeout) +
                          " (another process holds it)");
      step = detail::file_store::backoff(step, deadline, std::chrono::milliseconds(5));
    }
  }
  ~Lock() { unlock(); }
  Lock(const Lock&) = delete;
  Lock& operator=(const Lock&) = delete;

 private:
  bool try_lock(bool exclusive) {
#ifdef F_OFD_SETLK
    if (!use_flock_) {
      struct flock fl{};
      fl.l_type = static_cast<short>(exclusive ? F_WRLCK : F_RDLCK);
      fl.l_whence = SEEK_SET;
      if (::fcntl(fd_, F_OFD_SETLK, &fl) == 0) return true;
      if (errno != EINVAL) return false;
      use_flock_ = true;  // a kernel without OFD locks: flock() is per open file description too
    }
#endif
    use_flock_ = true;
    return ::flock(fd_, (exclusive ? LOCK_EX : LOCK_SH) | LOCK_NB) == 0;
  }
  void unlock() noexcept {
    if (use_flock_) {
      (void)::flock(fd_, LOCK_UN);
      return;
    }
#ifdef F_OFD_SETLK
    struct flock fl{};
    fl.l_type = F_UNLCK;
    fl.l_whence = SEEK_SET;
    (void)::fcntl(fd_, F_OFD_SETLK, &fl);
#endif
  }

  int fd_;
  bool use_flock_ = false;
};

inline FileStore::FileStore(std::string path, std::chrono::milliseconds timeout)
    : Store(timeout), path_(std::move(path)) {
  if (path_.empty()) throw InvalidArgument("store.open", rank(), "FileStore needs a path, got an empty one");
  fd_.reset(::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (!fd_) throw BackendError("store.open", rank(), "cannot open '" + path_ + "': " + detail::errno_text(errno));
  struct stat st{};
  if (::fstat(fd_.get(), &st) == 0 && !S_ISREG(st.st_mode))
    throw InvalidArgument("store.open", rank(), "'" + path_ + "' is not a regular file");
  std::lock_guard g(mu_);
  Lock lk(*this, false, "store.open", detail::deadline_after(this->timeout()), this->timeout());
  replay("store.open", false);
}

inline FileStore::~FileStore() = default;

// Applies records appended since the last replay. Call with mu_ and the file lock held.
inline void FileStore::replay(std::string_view op, bool writer) {
  namespace fs = detail::file_store;
  struct stat st{};
  if (::fstat(fd_.get(), &st) != 0)
    throw BackendError(std::string(op), rank(), "cannot stat '" + path_ + "': " + detail::errno_text(errno));
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size < replayed_)
    throw Error(std::string(op), rank(),
                "store file '" + path_ + "' shrank from " + std::to_string(replayed_) + " to " + std::to_string(size) +
                    " bytes: something else truncated or replaced it");
  if (size == replayed_ && replayed_ != 0) return;

  auto read_at = [&](std::uint64_t off, std::span<std::uint8_t> buf) {
    std::size_t got = 0;
    while (got < buf.size()) {
      const ssize_t n = ::pread(fd_.get(), buf.data() + got, buf.size() - got, static_cast<off_t>(off + got));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0)
        throw BackendError(std::string(op), rank(), "cannot read '" + path_ + "': " + detail::errno_text(errno));
      if (n == 0) break;
      got += static_cast<std::size_t>(n);
    }
    return got;
  };
  auto write_at = [&](std::uint64_t off, std::span<const std::uint8_t> buf) {
    std::size_t put = 0;
    while (put < buf.size()) {
      const ssize_t n = ::pwrite(fd_.get(), buf.data() + put, buf.size() - put, static_cast<off_t>(off + put));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        throw BackendError(std::string(op), rank(), "cannot write '" + path_ + "': " + detail::errno_text(errno));
      put += static_cast<std::size_t>(n);
    }
  };

  if (replayed_ == 0) {
    if (size < fs::header_size) {
      // Empty (or a header cut short by a writer that died): the first writer lays the header.
      if (!writer) return;
      if (size != 0 && ::ftruncate(fd_.get(), 0) != 0)
        throw BackendError(std::string(op), rank(), "cannot truncate '" + path_ + "': " + detail::errno_text(errno));
      write_at(0, std::span(reinterpret_cast<const std::uint8_t*>(fs::header), fs::header_size));
      replayed_ = fs::header_size;
      return;
    }
    std::uint8_t h[fs::header_size];
    if (read_at(0, h) != fs::header_size || std::memcmp(h, fs::header, fs::header_size) != 0)
      throw Error(std::string(op), rank(), "'" + path_ + "' is not a comm FileStore file (bad header)");
    replayed_ = fs::header_size;
  }
  if (size == replayed_) return;

  std::vector<std::uint8_t> buf(static_cast<std::size_t>(size - replayed_));  // bounded by the file's real size
  buf.resize(read_at(replayed_, buf));
  std::size_t pos = 0;
  while (buf.size() - pos >= fs::record_header_size) {
    detail::store_proto::Reader r{std::span<const std::uint8_t>(buf).subspan(pos)};
    const auto type = r.u8();
    const std::uint64_t klen = r.u32();
    const std::uint64_t vlen = r.u64();
    if (type != 'S' && type != 'D')
      throw Error(std::string(op), rank(),
                  "store file '" + path_ + "' is corrupt at offset " + std::to_string(replayed_ + pos));
    if (klen > r.left() || vlen > r.left() - klen) break;  // a record still being cut short: stop here
    const auto key = r.raw(static_cast<std::size_t>(klen));
    const auto val = r.raw(static_cast<std::size_t>(vlen));
    std::string k(reinterpret_cast<const char*>(key.data()), key.size());
    if (type == 'S') {
      kv_.insert_or_assign(std::move(k), Bytes(val.begin(), val.end()));
    } else {
      kv_.erase(k);
    }
    pos += fs::record_header_size + key.size() + val.size();
  }
  replayed_ += pos;
  if (writer && replayed_ < size && ::ftruncate(fd_.get(), static_cast<off_t>(replayed_)) != 0)
    throw BackendError(std::string(op), rank(), "cannot truncate '" + path_ + "': " + detail::errno_text(errno));
}

// Appends one record and applies it. Call with mu_ and the exclusive lock held, after replay().
inline void FileStore::append(std::string_view op, char type, std::string_view key,
                              std::span<const std::uint8_t> value) {
  if (key.size() > UINT32_MAX)
    throw InvalidArgument(std::string(op), rank(), "key of " + std::to_string(key.size()) + " bytes is too long");
  std::vector<std::uint8_t> rec;
  rec.reserve(detail::file_store::record_header_size + key.size() + value.size());
  detail::store_proto::Writer w(rec);
  w.u8(static_cast<std::uint8_t>(type));
  w.u32(static_cast<std::uint32_t>(key.size()));
  w.u64(value.size());
  w.raw(detail::as_bytes(key));
  w.raw(value);
  std::size_t put = 0;
  while (put < rec.size()) {
    const ssize_t n =
        ::pwrite(fd_.get(), rec.data() + put, rec.size() - put, static_cast<off_t>(replayed_ + put));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = n < 0 ? errno : EIO;
      // Leave no partial record behind; the next writer would cut it off anyway.
      (void)::ftruncate(fd_.get(), static_cast<off_t>(replayed_));
      throw BackendError(std::string(op), rank(), "cannot write '" + path_ + "': " + detail::errno_text(e));
    }
    put += static_cast<std::size_t>(n);
  }
  replayed_ += rec.size();
  if (type == 'S') {
    kv_.insert_or_assign(std::string(key), Bytes(value.begin(), value.end()));
  } else {
    kv_.erase(std::string(key));
  }
}

inline void FileStore::set(std::string_view key, std::span<const std::uint8_t> value) {
  std::lock_guard g(mu_);
  Lock lk(*this, true, "store.set", detail::deadline_after(timeout()), timeout());
  replay("store.set", true);
  append("store.set", 'S', key, value);
}

// Looks (`look()` under the lock, after replaying the log when it grew, the first time always)
// until `look` says done (true) or the deadline passes (false), backing off between looks.
template <class Look>
bool FileStore::poll(std::string_view op, std::chrono::milliseconds timeout, Look&& look) {
  const auto deadline = detail::deadline_after(timeout);
  auto step = std::chrono::microseconds(500);
  for (bool first = true;; first = false) {
    {
      std::lock_guard g(mu_);
      struct stat st{};
      const bool changed = ::fstat(fd_.get(), &st) != 0 || static_cast<std::uint64_t>(st.st_size) != replayed_;
      if (first || changed) {
        Lock lk(*this, false, op, deadline, timeout);
        replay(op, false);
      }
      if (look()) return true;
    }
    if (detail::Clock::now() >= deadline) return false;
    step = detail::file_store::backoff(step, deadline, std::chrono::milliseconds(10));
  }
}

inline Store::Bytes FileStore::get(std::string_view key) {
  const auto t = timeout();
  Bytes value;
  const bool found = poll("store.get", t, [&] {
    const auto it = kv_.find(key);
    if (it == kv_.end()) return false;
    value = it->second;
    return true;
  });
  if (found) return value;
  const std::string k(key);
  throw Timeout("store.get", rank(),
                detail::describe_keys({&k, 1}) + " not set within " + detail::format_ms(t) + " (file '" + path_ + "')");
}

inline std::int64_t FileStore::add(std::string_view key, std::int64_t delta) {
  std::lock_guard g(mu_);
  Lock lk(*this, true, "store.add", detail::deadline_after(timeout()), timeout());
  replay("store.add", true);
  auto it = kv_.find(key);
  auto r = detail::apply_add(key, it == kv_.end() ? nullptr : &it->second, delta);
  if (!r.error.empty()) throw InvalidArgument("store.add", rank(), r.error);
  const auto v = detail::format_counter(r.value);
  append("store.add", 'S', key, v);
  return r.value;
}

inline Store::Bytes FileStore::compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                                           std::span<const std::uint8_t> desired) {
  std::lock_guard g(mu_);
  Lock lk(*this, true, "store.compare_set", detail::deadline_after(timeout()), timeout());
  replay("store.compare_set", true);
  auto it = kv_.find(key);
  if (detail::cas_matches(it == kv_.end() ? nullptr : &it->second, expected)) {
    append("store.compare_set", 'S', key, desired);
    return Bytes(desired.begin(), desired.end());
  }
  return it == kv_.end() ? Bytes{} : it->second;
}

inline std::vector<std::string> FileStore::missing(const std::vector<std::string>& keys) {
  std::vector<std::string> m;
  for (const auto& k : keys)
    if (kv_.find(k) == kv_.end()) m.push_back(k);
  return m;
}

inline void FileStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::vector<std::string> m;
  if (poll("store.wait", timeout, [&] {
        m = missing(keys);
        return m.empty();
      }))
    return;
  throw Timeout("store.wait", rank(),
                detail::describe_keys(m) + " not set within " + detail::format_ms(timeout) + " (file '" + path_ + "')");
}

inline std::int64_t FileStore::num_keys() {
  std::lock_guard g(mu_);
  Lock lk(*this, false, "store.num_keys", detail::deadline_after(timeout()), timeout());
  replay("store.num_keys", false);
  return static_cast<std::int64_t>(kv_.size());
}

inline bool FileStore::delete_key(std::string_view key) {
  std::lock_guard g(mu_);
  Lock lk(*this, true, "store.delete_key", detail::deadline_after(timeout()), timeout());
  replay("store.delete_key", true);
  if (kv_.find(key) == kv_.end()) return false;
  append("store.delete_key", 'D', key, {});
  return true;
}

inline bool FileStore::check(std::string_view key) {
  std::lock_guard g(mu_);
  Lock lk(*this, false, "store.check", detail::deadline_after(timeout()), timeout());
  replay("store.check", false);
  return kv_.find(key) != kv_.end();
}

}  // namespace comm
