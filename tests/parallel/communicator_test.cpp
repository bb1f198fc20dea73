// The Communicator interface, vocab_shard and check_on_every_rank; built single-process and under
// mpirun with 1, 2 and 3 ranks (tests/parallel/world.hpp).
#include <embedhead/parallel/communicator.hpp>

#include "world.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <vector>

using namespace embedhead;
using test_support::world;

TEST_CASE("vocab_shard: balanced, contiguous, covering, uneven V") {
  for (int size = 1; size <= 7; ++size)
    for (Index V : {Index(7), Index(8), Index(50), Index(50257)}) {
      if (V < size) continue;
      Index next = 0;
      for (int r = 0; r < size; ++r) {
        const VocabShard s = vocab_shard(V, r, size);
        CHECK(s.begin == next);
        CHECK((s.rows() == V / size || s.rows() == V / size + 1));
        CHECK((s.rows() == V / size + 1) == (r < V % size));
        for (Index v = s.begin; v < s.end; ++v) CHECK(vocab_owner(V, v, size) == r);
        next = s.end;
      }
      CHECK(next == V);
    }
  CHECK_THROWS_AS(vocab_shard(2, 0, 3), value_error);
  CHECK_THROWS_AS(vocab_shard(10, 3, 3), value_error);
  CHECK_THROWS_AS(vocab_shard(10, -1, 3), value_error);
  CHECK_THROWS_AS(vocab_shard(10, 0, 0), value_error);
  CHECK_THROWS_WITH(vocab_shard(2, 0, 3), Catch::Contains("V = 2") && Catch::Contains("size 3"));
}

TEST_CASE("collectives: all_reduce sum and max, all_gather_v with different counts") {
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank();
  REQUIRE(R >= 1);
  REQUIRE(me >= 0);
  REQUIRE(me < R);

  std::vector<double> d = {1.0 + me, -2.0 * me, 0.5};
  comm.all_reduce_sum(d.data(), 3);
  double sum_ranks = 0;
  for (int r = 0; r < R; ++r) sum_ranks += r;
  CHECK(d[0] == R + sum_ranks);
  CHECK(d[1] == -2.0 * sum_ranks);
  CHECK(d[2] == 0.5 * R);

  std::vector<float> f = {static_cast<float>(me), static_cast<float>(-me)};
  comm.all_reduce_max(f.data(), 2);
  CHECK(f[0] == static_cast<float>(R - 1));
  CHECK(f[1] == 0.0f);

  std::vector<std::int64_t> i = {std::int64_t(1) << 40, me};
  comm.all_reduce_sum(i.data(), 2);
  CHECK(i[0] == R * (std::int64_t(1) << 40));
  CHECK(i[1] == static_cast<std::int64_t>(sum_ranks));

  // Rank r sends r + 1 values r*10, r*10 + 1, ...; rank 0 of an odd size also sends none.
  std::vector<Index> counts(static_cast<std::size_t>(R));
  for (int r = 0; r < R; ++r) counts[static_cast<std::size_t>(r)] = (r == 0 && R == 3) ? 0 : r + 1;
  std::vector<std::int64_t> send(static_cast<std::size_t>(counts[static_cast<std::size_t>(me)]));
  for (std::size_t k = 0; k < send.size(); ++k) send[k] = me * 10 + static_cast<std::int64_t>(k);
  Index total = 0;
  for (Index c : counts) total += c;
  std::vector<std::int64_t> recv(static_cast<std::size_t>(total), -1);
  comm.all_gather_v(send.data(), recv.data(), counts);
  std::size_t at = 0;
  for (int r = 0; r < R; ++r)
    for (Index k = 0; k < counts[static_cast<std::size_t>(r)]; ++k) CHECK(recv[at++] == r * 10 + k);

  const std::vector<std::int64_t> all = comm.all_gather(100 + me);
  REQUIRE(all.size() == static_cast<std::size_t>(R));
  for (int r = 0; r < R; ++r) CHECK(all[static_cast<std::size_t>(r)] == 100 + r);

  CHECK_THROWS_AS(comm.all_gather_v(send.data(), recv.data(), std::vector<Index>(static_cast<std::size_t>(R + 1), 0)),
                  shape_error);
}

TEST_CASE("check_on_every_rank: one rank's failure is every rank's, with the same message") {
  Communicator& comm = world();
  const int R = comm.size(), me = comm.rank();
  // Nothing fails: returns on every rank.
  CHECK_NOTHROW(check_on_every_rank(
      comm, "test", [] {}, 42));

  // The last rank fails with an index_error; every rank throws it, naming that rank.
  const int bad = R - 1;
  std::string message;
  try {
    check_on_every_rank(comm, "test", [&] {
      if (me == bad) throw index_error("test: id 99 at (b=0, t=2) outside [0, 50)");
    });
  } catch (const index_error& e) {
    message = e.what();
  }
  std::string expected = "test: id 99 at (b=0, t=2) outside [0, 50)";
  if (R > 1) expected += " [on rank " + std::to_string(bad) + " of " + std::to_string(R) + "]";
  CHECK(message == expected);

  // Two ranks fail with different kinds: the lowest failing rank's wins everywhere.
  if (R >= 2) {
    CHECK_THROWS_AS(check_on_every_rank(comm, "test",
                                        [&] {
                                          if (me == 1) throw shape_error("test: rank one's shape");
                                          if (me == 0) throw value_error("test: rank zero's value");
                                        }),
                    value_error);
    // Different fingerprints: value_error naming what differs.
    CHECK_THROWS_WITH(check_on_every_rank(
                          comm, "test", [] {}, static_cast<std::uint64_t>(me == 0 ? 1 : 2), "the token ids"),
                      Catch::Contains("ranks 0 and 1 of " + std::to_string(R) + " disagree on the token ids"));
  } else {
    CHECK_THROWS_AS(check_on_every_rank(comm, "test", [] { throw shape_error("test: shape"); }), shape_error);
  }
  // A collective still works after the failures: nobody is left inside one.
  std::int64_t one = 1;
  comm.all_reduce_sum(&one, 1);
  CHECK(one == R);
}

TEST_CASE("detail::gather_unit: a divisor of every byte count that fits MPI's int counts") {
  const Index row = 2048 * 4;  // a row of d = 2048 floats
  {
    const Index counts[3] = {3 * row, 0, 5 * row};
    CHECK(detail::gather_unit(counts, 3) == row);  // whole rows: one unit per row
  }
  {
    const Index counts[2] = {0, 0};
    CHECK(detail::gather_unit(counts, 2) == 1);
  }
  {
    // Equal blocks of 2^31 bytes (262,144 rows of 2048 floats): the gcd, 2^31, does not fit an
    // int; 2^30 does, so each rank sends 2 units.
    const Index counts[2] = {Index(1) << 31, Index(1) << 31};
    const Index unit = detail::gather_unit(counts, 2);
    CHECK(unit == Index(1) << 30);
    CHECK(counts[0] % unit == 0);
  }
  {
    // 2.1 million rows of 1024 bytes on each of 2 ranks (2,150,400,000 bytes, above INT_MAX).
    const Index counts[2] = {Index(2100000) * 1024, Index(2100000) * 1024};
    const Index unit = detail::gather_unit(counts, 2);
    CHECK(unit <= 2147483647);
    CHECK(counts[0] % unit == 0);
    CHECK(counts[0] / unit <= 2147483647);
    CHECK(2 * counts[0] / unit <= 2147483647);
  }
  {
    // With a small limit the gcd 240 = 2^4 * 3 * 5 is divided by its smallest factor until it
    // fits: 240 -> 120 -> 60.
    const Index counts[2] = {240, 480};
    CHECK(detail::gather_unit(counts, 2, 100) == 60);
  }
  {
    // A gcd that is a prime above the limit cannot be divided: unit 1.
    const Index counts[1] = {2147483659};  // prime, 2^31 + 11
    CHECK(detail::gather_unit(counts, 1) == 1);
  }
}
