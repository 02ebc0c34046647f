#!/usr/bin/env python3
"""Writes hand-made seed inputs for store_protocol_fuzz (one valid example of every request and
reply, plus a few hostile ones) into the directory given (default: fuzz/seeds). The committed
corpus (fuzz/corpus/store) grew from these; see scripts/sanitize for how it is minimized."""
import hashlib
import os
import struct
import sys

MAGIC, VERSION, TOKEN = 0x54534D43, 2, b"fuzz-token"
SET, GET, ADD, CAS, WAIT, CHECK, NUM, DEL, WATCH, BEAT, MGET = 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11


def s(b):  # u64 length | bytes
    b = b.encode() if isinstance(b, str) else b
    return struct.pack("<Q", len(b)) + b


def frame(payload):
    return struct.pack("<Q", len(payload)) + payload


def req(op, *fields):
    return frame(bytes([op]) + b"".join(fields))


def hello(token=TOKEN, version=VERSION, rank=1, job=b""):
    h = struct.pack("<IHHi", MAGIC, version, len(token), rank) + token
    return h + struct.pack("<H", len(job)) + job if version >= 2 else h  # version 1: no job id


def hello_reply(status=0, msg=b""):
    return struct.pack("<IHBH", MAGIC, VERSION, status, len(msg)) + msg


u32 = lambda v: struct.pack("<I", v)
u64 = lambda v: struct.pack("<Q", v)
i64 = lambda v: struct.pack("<q", v)

server = {  # flags 0x01: the target sends a valid hello first
    "set": req(SET, s("k"), s("v")),
    "get_hit": req(SET, s("k"), s("v")) + req(GET, s("k"), u64(0)),
    "get_miss": req(GET, s("absent"), u64(0)),
    "get_parks": req(GET, s("absent"), u64(50)),
    "add": req(ADD, s("n"), i64(5)) + req(ADD, s("n"), i64(-7)),
    "add_overflow": req(ADD, s("n"), i64(2**63 - 1)) + req(ADD, s("n"), i64(1)),
    "add_not_int": req(SET, s("n"), s("x")) + req(ADD, s("n"), i64(1)),
    "cas": req(CAS, s("c"), s(""), s("1")) + req(CAS, s("c"), s("1"), s("2")) + req(CAS, s("c"), s("9"), s("3")),
    "wait": req(SET, s("a"), s("1")) + req(WAIT, u32(2), s("a"), s("b"), u64(0)),
    "wait_parks": req(WAIT, u32(2), s("a"), s("b"), u64(30)),
    "check": req(CHECK, u32(2), s("a"), s("k")),
    "num_keys": req(NUM),
    "delete": req(SET, s("d"), s("1")) + req(DEL, s("d")) + req(DEL, s("d")),
    "unknown_op": req(99),
    "malformed": req(SET, u64(1000)),
    "trailing": req(NUM, b"\x01"),
    "key_too_long": req(SET, s("k" * 100), s("v")) + req(NUM),
    "value_too_long": req(SET, s("k"), s("v" * 300)) + req(NUM),
    "store_full": b"".join(req(SET, s("k%d" % i), s("v" * 250)) for i in range(20)),
    "zero_length": frame(b""),
    "huge_length": u64(2**63),
    "half_frame": u64(100) + b"\x01" * 10,
    "many_keys": req(WAIT, u32(50), *[s("") for _ in range(50)], u64(0)),
    "count_lies": req(WAIT, u32(0xFFFFFFFF), s("a"), u64(0)),
    "watch_beat": req(WATCH, s("dead"), s("1|"), u64(1000)) + req(BEAT, u64(0)) + req(SET, s("dead"), s("2|x")) + req(BEAT, u64(0)),
    "watch_cancel": req(WATCH, s("dead"), s("1|"), u64(1000)) + req(WATCH, s(""), s(""), u64(0)) + req(BEAT, u64(0)),
    "watch_silent": req(WATCH, s("dead"), s("1|"), u64(1)) + req(GET, s("dead"), u64(30)),
    "beat_parks": req(WATCH, s("dead"), s("1|"), u64(200)) + req(BEAT, u64(50)) + req(BEAT, u64(50)),
    "multi_get": req(SET, s("a"), s("1")) + req(MGET, u32(2), s("a"), s("a"), u64(0)),
    "multi_get_miss": req(SET, s("a"), s("1")) + req(MGET, u32(2), s("a"), s("b"), u64(0)),
    "multi_get_parks": req(MGET, u32(2), s("a"), s("b"), u64(30)),
    "multi_get_deleted": req(SET, s("a"), s("1")) + req(MGET, u32(2), s("a"), s("b"), u64(40)) + req(DEL, s("a")),
}
raw = {  # flags 0x00: the input is the whole stream, hello included
    "hello_set": hello() + req(SET, s("k"), s("v")),
    "wrong_token": hello(b"nope") + req(NUM),
    "no_token": hello(b"") + req(NUM),
    "bad_version": hello(version=3) + req(NUM),
    "hello_v1": hello(version=1) + req(NUM),
    "wrong_job": hello(job=b"another-job") + req(NUM),
    "job_too_long": hello()[:-2] + struct.pack("<H", 300) + b"j" * 300,
    "half_job": hello(job=b"another-job")[:-5],
    "bad_magic": b"GET / HTTP/1.0\r\n\r\n",
    "token_too_long": struct.pack("<IHHi", MAGIC, VERSION, 5000, 0),
    "half_hello": hello()[:7],
}
two = {  # flags 0x05, param = split point: a get parks on A, the set on B wakes it
    "park_wake": (req(GET, s("w"), u64(2000)), req(SET, s("w"), s("x"))),
    "will_wakes": (req(GET, s("dead"), u64(2000)), req(WATCH, s("dead"), s("1|"), u64(60000))),
    "beat_woken": (req(WATCH, s("dead"), s("1|"), u64(5000)) + req(BEAT, u64(2000)), req(SET, s("dead"), s("2|x"))),
    "wait_wake": (req(WAIT, u32(2), s("p"), s("q"), u64(2000)), req(SET, s("p"), s("1")) + req(SET, s("q"), s("1"))),
    "multi_get_wake": (req(MGET, u32(2), s("p"), s("q"), u64(2000)),
                       req(SET, s("q"), s("1")) + req(DEL, s("q")) + req(SET, s("p"), s("2")) + req(SET, s("q"), s("3"))),
}
# flags 0x80, param = first call + 8 * second call (0 get, 1 set, 2 add, 3 compare_set, 4 wait,
# 5 num_keys, 6 delete_key, 7 check): a good reply for each call, each followed by a check's reply
ok_reply = [frame(b"\x00" + s("v")), frame(b"\x00"), frame(b"\x00" + i64(1)), frame(b"\x00" + s("1")),
            frame(b"\x00"), frame(b"\x00" + i64(3)), frame(b"\x00\x01"), frame(b"\x00\x01")]
client_ok = [(call + 8 * 7, ok_reply[call] + ok_reply[7]) for call in range(8)]
client = {  # flags 0x80, param 0: replies to a get, then a get
    "timeout_keys": frame(b"\x01" + u32(1) + s("k")),
    "invalid": frame(b"\x02" + s("refused")),
    "failed": frame(b"\x03" + s("store full")),
    "unknown_status": frame(b"\x07"),
    "huge_reply": u64(2**40),
    "zero_reply": u64(0),
    "short_value": frame(b"\x00" + u64(100) + b"ab"),
    "trailing": frame(b"\x00" + s("v") + b"zz"),
}
client.update({"watch_beat_%d" % i: v for i, v in enumerate([
    frame(b"\x00" + s("v")) + frame(b"\x00" + struct.pack("<i", 0)) + frame(b"\x00\x01" + s("3|gone")),
    frame(b"\x00" + s("v")) + frame(b"\x00" + struct.pack("<i", 0)) + frame(b"\x00\x00" + s("")),
])})  # param 0x40: get, watch, heartbeat
client_raw = {  # flags 0x81: the hello reply is fuzzed too
    "ok": hello_reply() + frame(b"\x00" + s("v")),
    "wrong_token": hello_reply(2, b"wrong token"),
    "bad_version": hello_reply(1, b"v2"),
    "too_many": hello_reply(3, b"server at its connection limit"),
    "wrong_job": hello_reply(4, b"job-1"),
    "bad_magic": b"HTTP/1.0 400 Bad Request\r\n",
    "long_message": struct.pack("<IHBH", MAGIC, VERSION, 0, 60000),
}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "seeds")
    os.makedirs(out, exist_ok=True)
    inputs = [bytes([0x01, 0]) + v for v in server.values()]
    inputs += [bytes([0x03, 2]) + v for v in server.values()]  # in pieces of 3 bytes
    inputs += [bytes([0x00, 0]) + v for v in raw.values()]
    for a, b in two.values():
        inputs.append(bytes([0x05, len(a)]) + a + b)
    inputs += [bytes([0x80, param]) + v for param, v in client_ok]
    inputs += [bytes([0x80, 0x40 if k.startswith("watch") else 0]) + v for k, v in client.items()]
    inputs += [bytes([0x81, 0]) + v for v in client_raw.values()]
    for data in inputs:
        with open(os.path.join(out, hashlib.sha1(data).hexdigest()), "wb") as f:
            f.write(data)
    print("wrote %d seeds to %s" % (len(inputs), out))


if __name__ == "__main__":
    main()
