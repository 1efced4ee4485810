-- wrk: one single increment of 1 per request, each with a new event id: the run's
-- start time and the thread's number (wrk's threads share one unseeded random
-- generator, so random prefixes collide), then a sequence.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local threads, started = 0, os.time()
setup = function(thread)
  threads = threads + 1
  thread:set("prefix", string.format("%d-%d", started, threads))
end
local n = 0
request = function()
  n = n + 1
  return wrk.format(nil, nil, nil, string.format('{"delta": 1, "event_id": "w%s-%d"}', prefix, n))
end
