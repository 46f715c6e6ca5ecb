// An elementwise kernel in CUDA (written for maxkernel's tests): out[i] = relu(a[i] + b[i]).
__global__ void add_relu(const float* a, const float* b, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = a[i] + b[i];
        out[i] = v > 0.0f ? v : 0.0f;
    }
}
