-- The wrk script of bench/run.py: POST a small JSON body with an Idempotency-Key per request.
--
-- Arguments (after `--` on wrk's command line):
--   1 prefix      run-unique prefix of the new keys this run sends
--   2 retry_pct   percentage of requests that retry a stored key (0 = forward path, 100 = replay)
--   3 pool_prefix prefix of the stored keys, `<pool_prefix>-0` ... `<pool_prefix>-<N-1>`
--   4 pool_size   N (0 when retry_pct is 0)
--   5 path        request path, e.g. /emails
--   6 body        the request body (the same for every request, so retries match the fingerprint)
--
-- A new key is `<prefix>-<thread>-<sequence>`: unique across wrk's threads and across runs.
-- `done` prints one JSON line that bench/run.py reads: requests, errors, latency percentiles (us)
-- and how many new keys and retries were sent.

local threads = {}

function setup(thread)
   thread:set("id", #threads)
   table.insert(threads, thread)
end

function init(args)
   prefix = args[1]
   retry_share = tonumber(args[2]) / 100
   pool_prefix = args[3]
   pool_size = tonumber(args[4])
   path = args[5]
   body = args[6]
   headers = { ["Content-Type"] = "application/json" }
   sequence = 0
   new_sent = 0
   retries_sent = 0
   math.randomseed(os.time() * 1000 + id)
end

function request()
   local key
   if pool_size > 0 and retry_share > 0 and (retry_share >= 1 or math.random() < retry_share) then
      key = pool_prefix .. "-" .. math.random(0, pool_size - 1)
      retries_sent = retries_sent + 1
   else
      sequence = sequence + 1
      key = prefix .. "-" .. id .. "-" .. sequence
      new_sent = new_sent + 1
   end
   headers["Idempotency-Key"] = key
   return wrk.format("POST", path, headers, body)
end

function done(summary, latency, requests)
   local new, retries = 0, 0
   for _, thread in ipairs(threads) do
      new = new + thread:get("new_sent")
      retries = retries + thread:get("retries_sent")
   end
   local errors = summary.errors
   io.write(string.format(
      '{"requests": %d, "duration_us": %d, "connect_errors": %d, "read_errors": %d, '
         .. '"write_errors": %d, "status_errors": %d, "timeouts": %d, "p50_us": %.1f, '
         .. '"p99_us": %.1f, "mean_us": %.1f, "max_us": %.1f, "new_sent": %d, "retries_sent": %d}\n',
      summary.requests, summary.duration, errors.connect, errors.read, errors.write,
      errors.status, errors.timeout, latency:percentile(50), latency:percentile(99),
      latency.mean, latency.max, new, retries))
end
